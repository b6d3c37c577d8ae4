"""The dtypes a config can name, the parameter dtype a model computes in when the config names none, and whether
the machine computes bf16 natively: a GPU does, and so does a CPU with AVX512-BF16 or AMX (or, on Arm, the bf16
extension); any other CPU emulates it, many times slower than fp32.

    python -m fsdptrain.dtypes      # prints the dtype the task scripts default to here (bf16 or fp32), and why
"""

import os
import sys
import warnings

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo's names: x86's AVX512-BF16 and AMX, Arm's BF16


def compute_dtype(param_dtype: str | None, device: torch.device) -> torch.dtype:
    """`param_dtype`, or by default bf16 on a GPU and fp32 on CPU."""
    return DTYPES[param_dtype or ("bf16" if device.type == "cuda" else "fp32")]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them; empty where they cannot be read (then bf16 counts as emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith(("flags", "Features")) for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def bf16_is_native(device: torch.device, flags: set[str] | None = None, capability: str | None = None) -> bool:
    """Whether `device` computes bf16 natively; `flags`: the CPU's (default: this machine's); `capability`: torch's
    CPU capability (default: this process's)."""
    if device.type == "cuda":
        return True
    flags = cpu_flags() if flags is None else flags
    return has_bf16_instructions(flags) and not ("avx2" in flags and held_below_bf16(capability))


def has_bf16_instructions(flags: set[str]) -> bool:
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def held_below_bf16(capability: str | None = None) -> bool:
    """Whether torch's kernels (ATEN_CPU_CAPABILITY) or oneDNN's, which run the matmuls (ONEDNN_MAX_CPU_ISA), are
    told to use less than an x86 CPU's bf16 instructions: bf16 is then emulated whatever the CPU has."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return capability in ("DEFAULT", "AVX2") or not (isa in ("ALL", "DEFAULT") or "BF16" in isa or "AMX" in isa)


def machine_dtype(device: torch.device, flags: set[str] | None = None, capability: str | None = None) -> tuple[str, str]:
    """The compute dtype the task scripts default to on `device` (bf16 where native, else fp32), and why."""
    if device.type == "cuda":
        return "bf16", "a GPU computes bf16 natively"
    if bf16_is_native(device, flags, capability):
        return "bf16", "this CPU computes bf16 natively (AVX512-BF16, AMX or Arm's BF16)"
    if has_bf16_instructions(cpu_flags() if flags is None else flags):
        return "fp32", ("this CPU has bf16 instructions but torch or oneDNN is held below them (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), "
                        "so bf16 would be emulated, many times slower than fp32")
    return "fp32", "this CPU has neither AVX512-BF16 nor AMX, so bf16 would be emulated, many times slower than fp32"


def warn_if_emulated(dtype: str | None, key: str, device: torch.device, flags: set[str] | None = None, capability: str | None = None) -> None:
    """A warning where `key` asks for bf16 on a CPU that emulates it."""
    if dtype == "bf16" and not bf16_is_native(device, flags, capability):
        warnings.warn(f"{key}=bf16 on a CPU without AVX512-BF16 or AMX: bf16 is emulated here, an order of magnitude slower than fp32; "
                      f"set {key}=fp32 (or leave it null)", stacklevel=2)


if __name__ == "__main__":
    name, reason = machine_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"fsdptrain: computing in {name}: {reason} (DTYPE=... chooses)", file=sys.stderr)
    print(name)
