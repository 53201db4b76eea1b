"""Every input of every node is checked against its declaration (``nodes/inputs.py``) before the node works.

ComfyUI checks widget values against min / max and combo lists, but not values that arrive through a link (a core
PrimitiveInt, a wildcard output of another pack): these tests call each node's function directly, as ComfyUI's
executor does after validation, with one bad value at a time and every other input valid, and expect the node's
one-line error naming the input. ``tests/e2e/test_input_checks_e2e.py`` does the same through a real server.
"""

from __future__ import annotations

import math

import pytest
import torch

HUGE = 10**5000  # str() of it raises in Python >= 3.11 unless the message avoids printing it


def _declarations(cls) -> list[tuple[str, str, object, dict]]:
    """(section, input name, type or combo list, options) for every declared input of ``cls``."""
    out = []
    for section, inputs in cls.INPUT_TYPES().items():
        if section == "hidden":  # filled in by ComfyUI itself (UNIQUE_ID, PROMPT), not by a workflow
            continue
        for name, declaration in inputs.items():
            options = declaration[1] if len(declaration) > 1 else {}
            out.append((section, name, declaration[0], options))
    return out


class _FakePatcher:
    """Stands for ComfyUI's ModelPatcher (the MODEL type): a clone() and the model it patches."""

    model = None

    def clone(self):
        return self


@pytest.fixture(scope="module")
def valid_objects(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (tiny_vae,) = m["FewStepTinyVAELoader"]().load("dummy:taef1")
    (wan,) = m["FewStepDiTLoader"]().load("dummy:wan-tiny")
    session_ref = m["FewStepCausalVideoSampler"]().generate(
        wan, [[torch.zeros(1, 4, 4096), {}]], width=32, height=32, num_chunks=1, chunk_frames=1, window_frames=2,
        sink_frames=0, schedule="wan-dmd-4step", steps=1, seed=0,
    )[2]  # fmt: skip
    return {
        "FEWSTEP_MODEL": model,
        "FEWSTEP_TINY_VAE": tiny_vae,
        "FEWSTEP_SESSION": session_ref,
        "LATENT": {"samples": torch.zeros(1, 16, 8, 8)},
        "IMAGE": torch.zeros(1, 64, 64, 3),
        "CONDITIONING": [[torch.zeros(1, 4, 64), {}]],
        "MODEL": _FakePatcher(),
    }


def _valid_arguments(cls, objects) -> dict:
    """A value for every required input: the widget's default (a combo's first entry), or a valid object."""
    args = {}
    for section, name, kind, options in _declarations(cls):
        if section != "required":
            continue
        if isinstance(kind, list):
            args[name] = options.get("default", kind[0])
        elif kind in objects:
            args[name] = objects[kind]
        else:
            args[name] = options["default"]
    return args


def _out_of_range(cases, low, high):
    """Drop the integer cases that happen to lie inside [low, high] (2^63 is a valid seed)."""
    return [c for c in cases if not (type(c[0]) is int and low <= c[0] <= high)]


def _bad_values(kind, options) -> list[tuple[object, str]]:
    """(bad value, the expected message's tail) for a declared input."""
    low, high = options.get("min"), options.get("max")
    if kind == "INT":
        rng = f" in [{low}, {high}]"
        cases = [
            (high + 1, f"expected an integer{rng}, got {high + 1}"),
            (low - 1, f"expected an integer{rng}, got {low - 1}"),
            (2**63, f"expected an integer{rng}, got {2**63}"),
            (HUGE, f"expected an integer{rng}, got an integer of {HUGE.bit_length()} bits"),
            (float(low), f"expected an integer{rng}, got {float(low)!r}"),
            ("4", f"expected an integer{rng}, got the text '4'"),
            (True, f"expected an integer{rng}, got True (a boolean)"),
            (None, "expected a value, got none (is the link's source node disabled?)"),
        ]
        return _out_of_range(cases, low, high)
    if kind == "FLOAT":
        rng = f" in [{low}, {high}]"
        return [
            (high + 1.0, f"expected a finite number{rng}, got {high + 1.0!r}"),
            (low - 1.0, f"expected a finite number{rng}, got {low - 1.0!r}"),
            (math.nan, f"expected a finite number{rng}, got nan"),
            (math.inf, f"expected a finite number{rng}, got inf"),
            (-9.2e18, f"expected a finite number{rng}, got -9.2e+18"),
            (HUGE, f"expected a number{rng}, got an integer of {HUGE.bit_length()} bits"),
            ("0.5", f"expected a number{rng}, got the text '0.5'"),
            (False, f"expected a number{rng}, got False (a boolean)"),
        ]
    if kind == "BOOLEAN":
        return [
            ("false", "expected a boolean (true or false), got the text 'false'"),
            (0, "expected a boolean (true or false), got 0"),
            ([], "expected a boolean (true or false), got a list"),
        ]
    if kind == "STRING":
        return [
            (5, "expected text, got 5"),
            ("x" * 70000, "expected text of at most 65536 characters, got 70000"),
            ("a\ud800b", "is not valid text: it holds the unpaired surrogate U+D800"),
        ]
    if isinstance(kind, list):
        shown = ", ".join(repr(c) for c in kind[:12]) + (", ..." if len(kind) > 12 else "")
        return [
            ("no-such-choice", f"expected one of {shown}; got the text 'no-such-choice'"),
            (3, f"expected one of {shown}; got 3"),
        ]
    return [(7, "got 7"), ("text", "got the text 'text'"), ({"samples": 1}, "got a dict")]


FILE_LISTS = {("FewStepDiTLoader", "model_name"), ("FewStepLoraLoader", "lora_name"),
              ("FewStepTinyVAELoader", "vae_name"), ("FewStepCacheGate", "magcache_file"),
              ("FewStepCacheGateNative", "magcache_file")}  # fmt: skip


def test_every_node_checks_every_input_before_working(pack, valid_objects):
    checked = 0
    for node, cls in pack.NODE_CLASS_MAPPINGS.items():
        function = getattr(cls(), cls.FUNCTION)
        valid = _valid_arguments(cls, valid_objects)
        for section, name, kind, options in _declarations(cls):
            cases = _bad_values(kind, options)
            if (node, name) in FILE_LISTS:  # any text: the node resolves it itself (test_security_nodes)
                cases = [(5, "expected text, got 5"), ("a\udfffb", "unpaired surrogate U+DFFF")]
            for value, message in cases:
                if value is None and section != "required":
                    continue  # an optional input left unconnected
                with pytest.raises(ValueError) as err:
                    function(**{**valid, name: value})
                text = str(err.value)
                assert text.startswith(f"{node}: input '{name}': "), (node, name, value, text)
                assert message in text, (node, name, text)
                assert "\n" not in text and len(text) < 2000, (node, name)
                checked += 1
    assert checked > 250  # every node, every input: a guard against a walk that silently visits nothing


def test_in_range_values_pass_the_check_unchanged(pack):
    from fewstep.nodes.inputs import check_node_inputs

    for cls in pack.NODE_CLASS_MAPPINGS.values():
        for _section, name, kind, options in _declarations(cls):
            if kind in ("INT", "FLOAT"):
                for value in (options["min"], options["max"], options["default"]):
                    check_node_inputs(cls.INPUT_TYPES(), {name: value})
            elif isinstance(kind, list) and kind:
                check_node_inputs(cls.INPUT_TYPES(), {name: kind[-1]})


def test_the_huge_steps_of_the_issue_are_refused_before_any_allocation(pack, valid_objects):
    """steps = 2^31 through a link once allocated 21.5 GB in torch.linspace before anything refused it."""
    m = pack.NODE_CLASS_MAPPINGS
    for node, arguments in (
        ("FewStepSampler", dict(steps=2**31)),
        ("FewStepSchedule", dict(steps=2**31)),
        ("FewStepCausalVideoSampler", dict(steps=2**31)),
        ("FewStepStreamBatch", dict(schedule_steps=2**31)),
        ("FewStepStreamBatch", dict(frame_buffer_size=2**31)),
        ("FewStepSyntheticConditioning", dict(pooled_width=2**31)),
    ):
        cls = m[node]
        valid = _valid_arguments(cls, valid_objects)
        (name,) = arguments
        with pytest.raises(
            ValueError, match=rf"^{node}: input '{name}': expected an integer in \[\d+, \d+\], got"
        ):
            getattr(cls(), cls.FUNCTION)(**{**valid, **arguments})


def test_every_node_function_goes_through_the_shared_check(pack):
    for node, cls in pack.NODE_CLASS_MAPPINGS.items():
        function = getattr(cls, cls.FUNCTION)
        assert getattr(function, "checks_node_inputs", False), f"{node}.{cls.FUNCTION} skips nodes/inputs.py"


def _hostile_objects(kind: str) -> list:
    """Values of the right type that are wrong inside: empty, mis-shaped, non-finite, odd entries."""
    if kind == "STRING":
        return ["", " ", ",", "nan", "inf", "-inf", "1e309", "-1", "0", "0.5,0.5", "1,2", "9" * 5000,
                "1," * 3000, "\x00", "a\u202eb", "[]", "{}", "x" * 65536]  # fmt: skip
    if kind == "LATENT":
        return [{"samples": torch.zeros(0, 16, 8, 8)}, {"samples": torch.zeros(1, 16, 0, 0)},
                {"samples": torch.zeros(1, 3, 8, 8)}, {"samples": torch.zeros(16, 8, 8)},
                {"samples": torch.full((1, 16, 8, 8), math.nan)}, {"samples": torch.zeros(1, 16, 8, 8, dtype=torch.int64)},
                {"samples": torch.zeros(1, 16, 8, 8), "batch_index": "x"},
                {"samples": torch.zeros(1, 16, 8, 8), "noise_mask": torch.ones(1, 8, 8)}]  # fmt: skip
    if kind == "IMAGE":
        return [torch.zeros(0, 64, 64, 3), torch.zeros(1, 64, 64, 4), torch.full((1, 64, 64, 3), math.nan),
                torch.zeros(1, 7, 9, 3), torch.zeros(1, 64, 64, 3, dtype=torch.float16) + 2]  # fmt: skip
    if kind == "CONDITIONING":
        return [[], [[torch.zeros(1, 4, 64)]], [[torch.zeros(1, 4, 64), {"pooled_output": "x"}]],
                [[torch.zeros(1, 0, 64), {}]], [[torch.zeros(4, 64), {}]], [["text", {}]],
                [[torch.zeros(1, 4, 64), {"guidance": "x"}]], [[torch.zeros(1, 4, 64), {"strength": math.nan}]],
                [[torch.full((1, 4, 64), math.inf), {}]], [[torch.zeros(1, 4, 64), {"attention_mask": "x"}]]]  # fmt: skip
    return []


def test_hostile_values_of_the_right_type_end_in_the_nodes_one_line_error(pack, valid_objects):
    """Past the type checks, what is inside a value is the node's and the engine's to refuse: never a bare
    KeyError / IndexError / RuntimeError. (The launcher is left out: a valid value would start worker processes.)"""
    ran = 0
    for node, cls in pack.NODE_CLASS_MAPPINGS.items():
        if node == "FewStepParallelLauncher":
            continue
        function = getattr(cls(), cls.FUNCTION)
        valid = _valid_arguments(cls, valid_objects)
        for _section, name, kind, _options in _declarations(cls):
            for value in _hostile_objects(kind) if isinstance(kind, str) else []:
                try:
                    function(**{**valid, name: value})
                except ValueError as err:
                    text = str(err)
                    assert text.startswith(f"{node}: input '"), (node, name, text)
                    assert "\n" not in text, (node, name, text)
                except Exception as err:  # noqa: BLE001 - the point: any other exception fails the test
                    raise AssertionError(f"{node}.{name}={value!r:.80}: {type(err).__name__}: {err}") from err
                ran += 1
    assert ran > 100
