"""The names of the nodes behind a derived parameter, and the user path each stored node stands for.

A derived parameter at path `w` keeps its stored value at `w.base` (LoRA) or `w.codes` (quantized; under QLoRA
the dequantize is `w.base` and its codes stay `w.codes`) and its factors at `w.<suffix>`: `w.lora.a`, `w.lora.b`,
`w.scales`, and for DoRA `w.dora.a`, `w.dora.b`, `w.dora.magnitude` (its base is `w.base`, as LoRA's).
Users see Burn's paths: the stored value at `w` (as `visit` and records report it), the factors at their own names;
every pass that matches or records a node by path goes through `user_paths`.
"""

from __future__ import annotations

from .graph import Graph

BASE, CODES, SCALES = "base", "codes", "scales"
SCALE_SCALES, SCALE_OFFSET = "scales.scales", "scales.offset"  # double-quantized scales' second level
LORA_A, LORA_B = "lora.a", "lora.b"
DORA_A, DORA_B, DORA_MAGNITUDE = "dora.a", "dora.b", "dora.magnitude"


def derived(path: str, suffix: str) -> str:
    """The node `suffix` of the derived parameter at `path` (a factor, or its stored base)."""
    return f"{path}.{suffix}"


def suffix_of(path: str, name: str) -> str:
    """The suffix of node `name` below the derived parameter at `path` (the inverse of `derived`)."""
    if not name.startswith(f"{path}."):
        raise ValueError(f"@{name} is not a node of the derived parameter {path!r}")
    return name[len(path) + 1:]


def lora_base(path: str) -> str:
    return derived(path, BASE)


def lora_a(path: str) -> str:
    return derived(path, LORA_A)


def lora_b(path: str) -> str:
    return derived(path, LORA_B)


def dora_a(path: str) -> str:
    return derived(path, DORA_A)


def dora_b(path: str) -> str:
    return derived(path, DORA_B)


def dora_magnitude(path: str) -> str:
    return derived(path, DORA_MAGNITUDE)


def quant_codes(path: str) -> str:
    return derived(path, CODES)


def quant_scales(path: str) -> str:
    return derived(path, SCALES)


def quant_scale_factors(path: str, double: bool) -> tuple[str, ...]:
    """The dequantize operands after the codes: the scales, and under double quantization their group scales
    and offset."""
    return (quant_scales(path), derived(path, SCALE_SCALES), derived(path, SCALE_OFFSET)) if double else \
        (quant_scales(path),)


def stored_name(path: str, quantized: bool) -> str:
    """Where the stored value of the derived parameter at `path` lives: its codes if its innermost derivation
    dequantizes, else its LoRA base."""
    return quant_codes(path) if quantized else lora_base(path)


def stored_base(graph: Graph, name: str) -> str:
    """The stored parameter behind the derivation `name`, following a dequantized base to its codes."""
    while name in graph.reparams:
        name = graph.reparams[name].operands[0]
    return name


def user_paths(graph: Graph) -> dict[str, str]:
    """Each stored base of a derived parameter, mapped to the path the user sees for it (the outermost
    derivation's name); nodes not listed are seen at their own names."""
    inner = {r.operands[0] for r in graph.reparams.values()}  # QLoRA's dequantized base: not a user path
    return {stored_base(graph, name): name for name in graph.reparams if name not in inner}
