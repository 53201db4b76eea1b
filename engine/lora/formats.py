"""Recognising a LoRA file's naming and converting it to deltas on the model's official parameter names.

A LoRA file is a flat dict. Each entry is ``<prefix><module><suffix>``:

* the prefix says who wrote it: ``diffusion_model.`` (ComfyUI / BFL / lightx2v), ``transformer.`` (diffusers /
  PEFT / SimpleTuner), ``lora_unet_`` / ``lora_transformer_`` / ``lycoris_`` (kohya / OneTrainer / LyCORIS, with
  the module path joined by ``_``), ``base_model.model.`` (raw PEFT), or none;
* the module is an official module name of the family, or a foreign one (diffusers' ``transformer_blocks.0.
  attn.to_q``, XLabs' ``double_blocks.0.processor.qkv_lora1``) that the family's name map (``names_<family>``)
  turns into official modules, possibly a row slice of a fused one;
* the suffix says what the tensor is (:data:`SUFFIXES`).

Every entry must be used: a diffusion-model entry that maps to nothing is an error listing it; text-encoder
entries (``lora_te*``, ``text_encoder*``) are reported as not applied (the text encoder is not this model).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import CheckpointError
from .delta import WeightDelta
from .names import Target, foreign_names

# suffix -> role; "up"/"down" pair within one naming style
SUFFIXES: dict[str, str] = {
    ".lora_up.weight": "up",
    ".lora_down.weight": "down",
    ".lora_B.weight": "up",
    ".lora_A.weight": "down",
    ".lora_B.default.weight": "up",
    ".lora_A.default.weight": "down",
    ".lora.up.weight": "up",
    ".lora.down.weight": "down",
    "_lora.up.weight": "up",
    "_lora.down.weight": "down",
    ".lora_linear_layer.up.weight": "up",
    ".lora_linear_layer.down.weight": "down",
    ".up.weight": "up",  # XLabs: double_blocks.0.processor.qkv_lora1.up.weight
    ".down.weight": "down",
    ".lora_B": "up",
    ".lora_A": "down",
    ".alpha": "alpha",
    ".diff_b": "diff_b",
    ".diff": "diff",
    ".diff_m": "diff_m",  # lightx2v: a full delta of blocks.N.modulation, written as blocks.N.diff_m
}
# what a file may hold that this pack does not apply, with the reason
UNSUPPORTED: dict[str, str] = {
    ".dora_scale": "DoRA (dora_scale) LoRAs",
    ".lora_mid.weight": "LoCon mid weights (lora_mid, convolution LoRAs)",
    ".hada_w1_a": "LoHa (hada_*) files",
    ".lokr_w1": "LoKr (lokr_*) files",
    ".lokr_w1_a": "LoKr (lokr_*) files",
    ".set_weight": "weight-replacing entries (set_weight, BFL control LoRAs)",
    ".reshape_weight": "shape-changing entries (reshape_weight, BFL control LoRAs)",
    ".w_norm": "norm-weight entries (w_norm / b_norm)",
    ".oft_blocks": "OFT files",
}
UNDERSCORE_PREFIXES = ("lora_unet__", "lora_unet_", "lora_transformer_", "lycoris_")
DOT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.")
TEXT_ENCODER = re.compile(r"^(lora_te\d?_|text_encoders?\.|te\d?\.|lora_te_)")


@dataclass
class Converted:
    format: str
    deltas: list[WeightDelta]
    text_encoder_keys: list[str] = field(default_factory=list)


_SUFFIXES_LONGEST_FIRST = sorted(SUFFIXES, key=len, reverse=True)


def _splits(key: str) -> list[tuple[str, str, str]]:
    """Every (prefix, module, suffix) reading of one entry, the module still in the prefix's spelling, the
    longest suffix first. Several readings exist where a module name ends like a suffix: XLabs'
    ``processor.qkv_lora.up.weight`` is module ``processor.qkv_lora`` + ``.up.weight``, not ``processor.qkv`` +
    ``_lora.up.weight``; the caller keeps the first reading whose module the model has."""
    out = []
    for suffix in _SUFFIXES_LONGEST_FIRST:
        if not key.endswith(suffix):
            continue
        body = key[: -len(suffix)]
        prefix = next((p for p in UNDERSCORE_PREFIXES + DOT_PREFIXES if body.startswith(p)), "")
        out.append((prefix, body[len(prefix) :], suffix))
    return out


class NameResolver:
    """Module names of one model, and a family's foreign names, to :class:`Target` lists."""

    def __init__(self, model: nn.Module, foreign: dict[str, list[Target]]):
        self.params = dict(model.named_parameters())
        modules = {k.rsplit(".", 1)[0] for k in self.params if "." in k} | set(self.params)
        self.official = {m: [Target(m)] for m in modules}
        self.foreign = foreign
        self.underscored: dict[str, str] = {}
        for name in list(modules) + list(foreign):
            self.underscored.setdefault(name.replace(".", "_"), name)

    def resolve(self, prefix: str, module: str) -> list[Target] | None:
        if prefix in UNDERSCORE_PREFIXES:
            module = self.underscored.get(module, module)
        return self.foreign.get(module) or self.official.get(module)

    def param_for(self, module: str, role: str) -> str | None:
        if role == "diff_b":
            name = f"{module}.bias"
        elif role == "diff_m":
            name = f"{module}.modulation"
        else:
            name = f"{module}.weight"
        if name in self.params:
            return name
        return module if role in ("diff", "diff_m") and module in self.params else None


def _style(prefixes: Counter, suffixes: Counter, modules) -> str:
    p = prefixes.most_common(1)[0][0] if prefixes else ""
    names = {
        "lora_unet_": "kohya",
        "lora_unet__": "kohya (Wan Fun)",
        "lora_transformer_": "OneTrainer",
        "lycoris_": "LyCORIS / SimpleTuner",
        "transformer.": "diffusers / PEFT",
        "base_model.model.": "PEFT",
        "diffusion_model.": "ComfyUI / BFL",
        "model.diffusion_model.": "ComfyUI / BFL",
        "": "bare module names",
    }
    style = names.get(p, p)
    if any(".processor." in m for m in modules):
        style = "XLabs"
    if any(s in suffixes for s in (".diff", ".diff_b", ".diff_m")):
        style += " with full deltas (diff / diff_b)"
    return style


def key_patterns(keys, limit: int = 8) -> str:
    """Entry names with block numbers folded (``double_blocks.*.img_attn.qkv.lora_up.weight``), most common first."""
    counts = Counter(re.sub(r"(?<=[._])\d+(?=[._])", "*", k) for k in keys)
    shown = [f"{p} ({n})" for p, n in counts.most_common(limit)]
    if len(counts) > limit:
        shown.append(f"... {len(counts) - limit} more patterns")
    return ", ".join(shown)


def convert(
    sd: dict[str, torch.Tensor], model: nn.Module, family: str, source: str, input_name: str
) -> Converted:
    resolver = NameResolver(model, foreign_names(family, model))
    text_encoder = sorted(k for k in sd if TEXT_ENCODER.match(k))
    groups: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)  # (prefix, module) -> role -> entry
    unknown, unsupported = [], []
    prefixes, suffixes = Counter(), Counter()
    for key in sd:
        if key in text_encoder:
            continue
        bad = next((why for s, why in UNSUPPORTED.items() if key.endswith(s) or s + "." in key), None)
        if bad is not None:
            unsupported.append((key, bad))
            continue
        readings = _splits(key)
        if not readings:
            unknown.append(key)
            continue
        prefix, module, suffix = next((r for r in readings if resolver.resolve(r[0], r[1])), readings[0])
        role = SUFFIXES[suffix]
        groups[(prefix, module)][role] = key
        prefixes[prefix] += 1
        suffixes[suffix] += 1
    if unsupported:
        kinds = sorted({why for _, why in unsupported})
        raise CheckpointError(
            input_name,
            f"{source} holds {'; '.join(kinds)}, which this pack does not apply (plain LoRA and full deltas only); "
            f"entries: {key_patterns([k for k, _ in unsupported])}",
        )
    if not groups and not unknown:
        raise CheckpointError(
            input_name,
            f"{source} holds no diffusion-model LoRA entries"
            + (f" (only text-encoder ones: {key_patterns(text_encoder)})" if text_encoder else ""),
        )
    if not groups:
        raise CheckpointError(
            input_name,
            f"{source} is not a LoRA in any naming this pack reads (no entry ends in lora_up / lora_down, "
            f"lora_A / lora_B, alpha, diff or diff_b); key patterns found: {key_patterns(unknown)}",
        )

    deltas: list[WeightDelta] = []
    unmatched: list[str] = list(unknown)
    for (prefix, module), roles in groups.items():
        entries = sorted(roles.values())
        targets = resolver.resolve(prefix, module)
        if targets is None:
            unmatched.extend(entries)
            continue
        made = _deltas(sd, prefix + module, roles, targets, resolver, source, input_name)
        if made is None:
            unmatched.extend(entries)
        else:
            deltas.extend(made)
    if unmatched:
        raise CheckpointError(
            input_name,
            f"{source}: {len(unmatched)} of {len(sd)} entries match no weight of this {family} model; nothing was "
            f"applied.\n  unmatched: {key_patterns(unmatched)}\n  {_family_hint(unmatched, family)}",
        )
    return Converted(_style(prefixes, suffixes, [m for _, m in groups]), deltas, text_encoder)


def _deltas(sd, where, roles, targets, resolver, source, input_name) -> list[WeightDelta] | None:
    out = []
    alpha = None
    if "alpha" in roles:
        a = sd[roles["alpha"]]
        if a.numel() != 1:
            raise CheckpointError(
                input_name, f"{source}: {roles['alpha']} should be one number, has shape {tuple(a.shape)}"
            )
        alpha = float(a.float().item())
    if ("up" in roles) != ("down" in roles):
        have = "up" if "up" in roles else "down"
        raise CheckpointError(
            input_name, f"{source}: {roles[have]} has no matching {'down' if have == 'up' else 'up'} tensor"
        )
    if "alpha" in roles and "up" not in roles:
        raise CheckpointError(
            input_name, f"{source}: {roles['alpha']} has no LoRA pair (lora_up / lora_down)"
        )
    for target in targets:
        if "up" in roles:
            key = resolver.param_for(target.module, "up")
            if key is None:
                return None
            up, down = sd[roles["up"]], sd[roles["down"]]
            if up.ndim < 2 or down.ndim < 2:
                raise CheckpointError(
                    input_name,
                    f"{source}: {roles['up']} and {roles['down']} must be matrices (found shapes "
                    f"{tuple(up.shape)} and {tuple(down.shape)})",
                )
            up = _transform(up, target)
            out.append(WeightDelta(key, where, up=up, down=down, alpha=alpha, rows=target.rows))
        for role in ("diff", "diff_b", "diff_m"):
            if role not in roles:
                continue
            key = resolver.param_for(target.module, role)
            if key is None:
                return None
            diff = sd[roles[role]]
            out.append(WeightDelta(key, where, diff=_transform(diff, target), rows=target.rows))
    return out


def _transform(t: torch.Tensor, target: Target) -> torch.Tensor:
    """The rows of the file's delta (an up matrix or a full delta) that land on ``target``, in its order."""
    if target.transform == "swap_halves":
        a, b = t.chunk(2, dim=0)
        t = torch.cat([b, a], dim=0)
    if target.take is not None:
        start, length = target.take
        if start + length > t.shape[0]:
            return t  # too short to split: the shape check names the entry and both shapes
        t = t.narrow(0, start, length)
    return t


_FAMILY_SIGNS = (
    ("flux", re.compile(r"(double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)")),
    ("wan", re.compile(r"blocks[._]\d+[._](self_attn|cross_attn|ffn|attn1|attn2)")),
    ("zimage", re.compile(r"(layers[._]\d+[._](attention|feed_forward)|noise_refiner|context_refiner)")),
    ("sd / sdxl unet", re.compile(r"(down_blocks|up_blocks|input_blocks|output_blocks|mid_block)")),
)


def _family_hint(keys, family: str) -> str:
    seen = [name for name, sign in _FAMILY_SIGNS if any(sign.search(k) for k in keys)]
    others = [s for s in seen if s != family]
    if others and family not in seen:
        return f"these names belong to a {' / '.join(others)} model: a LoRA for another model family"
    return (
        "a LoRA for another size or variant of this family, or a naming this pack does not know "
        "(it reads ComfyUI / BFL, diffusers / PEFT, kohya, OneTrainer, LyCORIS and XLabs names)"
    )
