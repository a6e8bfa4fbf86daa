"""Read facts out of a compiled kernel's text: access widths, spills, integer widths.

Pure text parsing (PTX, SASS from cuobjdump, the ptxas -v log, Triton's TTIR), so the parsers
are unit-tested on fixed snippets in tests/kernels/test_aot.py.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_PTX_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_PTX_TYPE = re.compile(r"^[bsuf](8|16|32|64|128)$")
_SASS_ACCESS = re.compile(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)")
_SASS_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128, "256": 256}
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
# `arith.muli %a, %b : tensor<8x1xi64>` or `: i32`: the element type of an integer multiply.
_TTIR_INT_OP = re.compile(r"\barith\.(muli|shli|trunci)\b[^:\n]*:\s*(?:tensor<(?:\d+x)*)?(i\d+)")


@dataclass(frozen=True)
class Access:
    op: str  # "ld" | "st"
    bits: int  # bits moved by one instruction (vector count x element width)
    in_loop: bool = False  # between a branch target and the backward branch to it


_PTX_LABEL = re.compile(r"^[ \t]*(\$\w+):", re.MULTILINE)
_PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$\w+);")
_SASS_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_SASS_BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)\s*;")


def _loops(labels: dict[str, int], branches: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) positions of loops: a branch back to a label placed before it."""
    return [(labels[t], at) for at, t in branches if t in labels and labels[t] < at]


def _inside(pos: int, loops: list[tuple[int, int]]) -> bool:
    return any(start <= pos <= end for start, end in loops)


def ptx_accesses(ptx: str) -> list[Access]:
    """Every global load and store of the PTX, e.g. ``ld.global.v4.b32`` -> ld 128 bits, and
    whether it sits in a loop (the kernels' column loop holds the copy itself; the pointer
    table and slot ids are loaded before it)."""
    labels = {m.group(1): m.start() for m in _PTX_LABEL.finditer(ptx)}
    loops = _loops(labels, [(m.start(), m.group(1)) for m in _PTX_BRANCH.finditer(ptx)])
    out = []
    for m in _PTX_ACCESS.finditer(ptx):
        op, suffix = m.groups()
        lanes, width = 1, None
        for part in suffix.split(".")[1:]:
            if part in ("v2", "v4", "v8"):
                lanes = int(part[1:])
            elif _PTX_TYPE.match(part):
                width = int(_PTX_TYPE.match(part).group(1))  # type: ignore[union-attr]
        if width is None:
            raise ValueError(f"PTX access without a type: {op}.global{suffix}")
        out.append(Access(op, lanes * width, _inside(m.start(), loops)))
    return out


def ptx_target(ptx: str) -> str:
    """The ``.target`` of a PTX module, e.g. sm_90a."""
    m = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    if m is None:
        raise ValueError("PTX without a .target line")
    return m.group(1)


def sass_accesses(sass: str) -> list[Access]:
    """Every LDG/STG of cuobjdump -sass output (no width suffix means 32 bits), and whether it
    sits in a loop (between a BRA's target address and the BRA, the target being before)."""
    lines = [
        (int(a.group(1), 16), line) for line in sass.splitlines() if (a := _SASS_ADDR.search(line))
    ]
    branches = [(at, b.group(1)) for at, line in lines if (b := _SASS_BRANCH.search(line))]
    loops = [(int(t, 16), at) for at, t in branches if int(t, 16) < at]
    out = []
    for at, line in lines:
        for op, suffix in _SASS_ACCESS.findall(line):
            widths = [_SASS_WIDTH[p] for p in suffix.split(".")[1:] if p in _SASS_WIDTH]
            bits = widths[-1] if widths else 32
            out.append(Access("ld" if op == "LDG" else "st", bits, _inside(at, loops)))
    return out


def histogram(accesses: list[Access]) -> dict[str, int]:
    """{"ld128": 8, "st128": 8, "ld64": 9}: how many instructions of each kind and width."""
    return dict(sorted(Counter(f"{a.op}{a.bits}" for a in accesses).items()))


def loop_accesses(accesses: list[Access]) -> list[Access] | None:
    """The accesses inside loops, or None when the kernel has no loop at all (a JIT-constant
    row of one element unrolls its single column step)."""
    inside = [a for a in accesses if a.in_loop]
    return inside or None


@dataclass(frozen=True)
class PtxasReport:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


def ptxas_report(log: str) -> PtxasReport:
    """Registers and spills from a ``ptxas -v`` log (one kernel)."""
    spills = _SPILLS.search(log)
    regs = _REGISTERS.search(log)
    if spills is None or regs is None:
        raise ValueError(f"no register/spill lines in the ptxas log: {log[-500:]!r}")
    stack, stores, loads = (int(x) for x in spills.groups())
    return PtxasReport(int(regs.group(1)), stack, stores, loads)


def ttir_narrow_int_ops(ttir: str) -> list[str]:
    """Integer multiplies/shifts narrower than 64 bits, and every truncation, in TTIR.

    The copy kernels' only products are address math (slot * row_elems, buffer * num_tokens);
    a 32-bit one overflows once a pool or a slab passes 2^31 elements.
    """
    found = []
    for op, ty in _TTIR_INT_OP.findall(ttir):
        if op == "trunci" or ty != "i64":
            found.append(f"arith.{op} {ty}")
    return found
