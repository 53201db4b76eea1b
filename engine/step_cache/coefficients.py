"""TeaCache's published rescaling polynomials, per model.

TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model") measures
the relative L1 change of a cheap probe between steps and maps it through a polynomial fitted per model to the
relative change of the model *output*; the mapped values are accumulated until they reach the threshold.
The polynomials below are the ones published with the method, coefficients highest degree first (numpy
``poly1d`` order):

* FLUX.1: ali-vilab/TeaCache, ``TeaCache4FLUX/teacache_flux.py`` (fitted on FLUX.1-dev); probe = block 0's
  modulated image input ``(1 + scale) * LayerNorm(img) + shift``.
* Wan 2.1 text-to-video 1.3B and 14B: ali-vilab/TeaCache, ``TeaCache4Wan2.1/teacache_generate.py`` (the default
  mode, ``use_ret_steps`` off); probe = the time embedding ``e`` (the input of the 6-way modulation projection).

They only mean something for the model they were fitted on, so TeaCache is refused for any other model
(:func:`teacache_coefficients_for`); ``coefficients=`` takes a published set by name or an explicit polynomial
for experiments. None is published for FLUX.2 or Z-Image (TeaCache's repository covers FLUX.1, Wan 2.1 and
older video / image models; the Lumina-2 set, the closest architecture to Z-Image, is fitted on Lumina-Image
2.0, another model): they are refused with that reason and pointed to First-Block-Cache or a MagCache
calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..loader import preset_of
from ..models.registry import FAMILIES


@dataclass(frozen=True)
class TeaCacheCoefficients:
    name: str
    family: str
    coefficients: tuple[float, ...]  # highest degree first
    source: str

    def rescale(self, x: float) -> float:
        out = 0.0
        for c in self.coefficients:  # Horner
            out = out * x + c
        return out


TEACACHE_COEFFICIENTS: dict[str, TeaCacheCoefficients] = {
    c.name: c
    for c in (
        TeaCacheCoefficients(
            "flux.1",
            "flux",
            (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01),
            "ali-vilab/TeaCache TeaCache4FLUX/teacache_flux.py",
        ),
        TeaCacheCoefficients(
            "wan2.1-t2v-1.3b",
            "wan",
            (2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01),
            "ali-vilab/TeaCache TeaCache4Wan2.1/teacache_generate.py (t2v-1.3B, use_ret_steps off)",
        ),
        TeaCacheCoefficients(
            "wan2.1-t2v-14b",
            "wan",
            (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404),
            "ali-vilab/TeaCache TeaCache4Wan2.1/teacache_generate.py (t2v-14B, use_ret_steps off)",
        ),
    )
}

# Engine presets (architectures) each published set was fitted on. FLUX.1-schnell has FLUX.1-dev's
# architecture minus the guidance embedding; the set is FLUX.1-dev's (schnell's schedules are refused anyway).
PRESET_COEFFICIENTS = {
    "flux.1-dev": "flux.1",
    "flux.1-schnell": "flux.1",
    "wan2.1-1.3b": "wan2.1-t2v-1.3b",
    "wan2.1-14b": "wan2.1-t2v-14b",
}


def family_title(family: str) -> str:
    """``"FLUX.2"`` for ``"flux2"``: the registry's description of an image family up to its parenthesis."""
    spec = FAMILIES[family].image if family in FAMILIES else None
    return spec.description.split(" (")[0] if spec is not None and spec.description else family


def published_models() -> str:
    return ", ".join(f"{preset} ({name})" for preset, name in PRESET_COEFFICIENTS.items())


def teacache_coefficients_for(
    model, override: str | tuple[float, ...] | None = None, input_name: str = "method"
) -> TeaCacheCoefficients:
    """The polynomial for ``model``: the published one for its architecture, or ``override`` (a published
    name or explicit coefficients). Raises :class:`InputError` when the model has none."""
    family = type(model).family
    if isinstance(override, str):
        if override not in TEACACHE_COEFFICIENTS:
            raise InputError(
                input_name,
                f"unknown TeaCache coefficient set {override!r}; published: {', '.join(TEACACHE_COEFFICIENTS)}",
            )
        chosen = TEACACHE_COEFFICIENTS[override]
        if chosen.family != family:
            raise InputError(
                input_name, f"TeaCache coefficients {override!r} are for {chosen.family} models, not {family}"
            )
        return chosen
    if override is not None:
        return TeaCacheCoefficients("custom", family, tuple(float(c) for c in override), "given explicitly")
    preset = preset_of(model)
    if family not in {c.family for c in TEACACHE_COEFFICIENTS.values()}:
        raise InputError(
            input_name,
            f"TeaCache needs a rescaling polynomial fitted on the model, and none is published for any "
            f"{family_title(family)} model (this one: {preset or 'a custom configuration'}); TeaCache's "
            f"polynomials exist only for {published_models()}. Use method 'first_block' (First-Block-Cache needs "
            "no per-model fit), or 'magcache' with a calibration file (calibrate on, once per step count)",
        )
    if preset not in PRESET_COEFFICIENTS:
        raise InputError(
            input_name,
            f"TeaCache needs a rescaling polynomial fitted on the model, and this {family} model "
            f"({preset or 'a custom configuration'}) has none; published polynomials exist for "
            f"{published_models()}. Use method 'first_block' (First-Block-Cache needs no per-model fit), or "
            "'magcache' with a calibration file",
        )
    return TEACACHE_COEFFICIENTS[PRESET_COEFFICIENTS[preset]]


__all__ = [
    "PRESET_COEFFICIENTS",
    "TEACACHE_COEFFICIENTS",
    "TeaCacheCoefficients",
    "teacache_coefficients_for",
]
