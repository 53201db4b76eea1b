"""A stand-in for ComfyUI's ``folder_paths`` module (0.3.64) with a base directory of its own.

It keeps the parts the pack relies on and their semantics: ``folder_names_and_paths`` (name -> (paths,
extensions); an empty extension set lists every file), ``get_full_path`` normalising the name inside each folder
(``relpath(join("/", name), "/")``: ``../x`` and ``/x`` are looked up *inside* the folder, as ComfyUI does) and
answering None when nothing is there, ``get_filename_list`` listing recursively with ``/`` separators.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

MODEL_EXTENSIONS = {".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft"}


def make_folder_paths(base: Path) -> types.ModuleType:
    fp = types.ModuleType("folder_paths")
    models = base / "models"
    fp.base_path = str(base)
    fp.models_dir = str(models)
    fp.folder_names_and_paths = {
        "diffusion_models": ([str(models / "unet"), str(models / "diffusion_models")], set(MODEL_EXTENSIONS)),
        "vae_approx": ([str(models / "vae_approx")], set(MODEL_EXTENSIONS)),
    }

    def get_output_directory() -> str:
        return str(base / "output")

    def add_model_folder_path(folder_name: str, full_folder_path: str, is_default: bool = False) -> None:
        if folder_name in fp.folder_names_and_paths:
            paths = fp.folder_names_and_paths[folder_name][0]
            if full_folder_path not in paths:
                paths.insert(0, full_folder_path) if is_default else paths.append(full_folder_path)
        else:
            fp.folder_names_and_paths[folder_name] = ([full_folder_path], set())

    def get_folder_paths(folder_name: str) -> list[str]:
        return fp.folder_names_and_paths[folder_name][0][:]

    def get_full_path(folder_name: str, filename: str) -> str | None:
        if folder_name not in fp.folder_names_and_paths:
            return None
        filename = os.path.relpath(os.path.join("/", filename), "/")
        for folder in fp.folder_names_and_paths[folder_name][0]:
            full_path = os.path.join(folder, filename)
            if os.path.isfile(full_path):
                return full_path
        return None

    def get_filename_list(folder_name: str) -> list[str]:
        paths, extensions = fp.folder_names_and_paths[folder_name]
        found = set()
        for folder in paths:
            for root, _dirs, files in os.walk(folder):
                for name in files:
                    rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
                    if not extensions or os.path.splitext(name)[1].lower() in extensions:
                        found.add(rel)
        return sorted(found)

    for fn in (
        get_output_directory,
        add_model_folder_path,
        get_folder_paths,
        get_full_path,
        get_filename_list,
    ):
        setattr(fp, fn.__name__, fn)
    return fp
