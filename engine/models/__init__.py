"""Model architectures. Module attribute names are the official checkpoint key names."""
