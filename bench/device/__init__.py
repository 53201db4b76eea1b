"""The prepared GPU check behind ``bench/device_check``: :mod:`.runner` runs independent checks under one time
budget and writes ``bench/results/device.json`` and ``.md``; :mod:`.checks` holds the checks, each a small
function of a :class:`~.runner.Setup` (full-size presets in bf16 on a GPU, tiny presets on a CPU for ``--smoke``).
"""
