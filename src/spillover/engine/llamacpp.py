"""llama-cpp-python as every model load in spillover gets it: ``load_llama_cpp()``.

The pinned llama.cpp's AMX code (ggml-cpu's ``AMX`` extra buffer type, which the CPU backend
moves a quantized model's weights into when the CPU has AMX and the build was compiled for it,
as a native build on such a CPU is) crashes the process at its first matrix product of more
than one token: SIGSEGV in ``ggml_backend_amx_mul_mat`` at ``ldtilecfg``. Seen here on a Xeon
with AMX_INT8 running the default model; upstream: llama.cpp issue #20824 (machine-dependent,
closed unfixed) and pull request #26954 (the tile permission is asked on the main thread only,
and the tile configuration on the stack is optimised away). A crash on the first real prompt
would take every worker down on such a machine, so where llama.cpp reports ``AMX_INT8 = 1``
every model is loaded with ``use_extra_bufts = False``: its weights stay in the plain CPU
buffer. That also leaves out the CPU backend's repacking of Q4_0/Q4_K/IQ4_NL/MXFP4 (and, with
AVX-512, Q2_K) weights (a decode speed-up on AVX2 machines), on AMX machines only: the memory model then counts no
repacked copy (``cpu_backend_repacks``).

The setting goes through llama-cpp-python's ``llama_model_default_params``, which its ``Llama``
constructor and spillover's own loads (``Engine``, ``plan_buffers``) both start from, so a
bare ``Llama`` in a benchmark or a test, once this was called, loads as the workers do.
"""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = [
    "OP_OFFLOAD",
    "amx_in_cpu_backend",
    "cpu_backend_repacks",
    "cpu_repack_rules",
    "load_llama_cpp",
    "repack_rules_for",
]


# Every llama context spillover makes (``Engine``, ``plan_buffers``, ``measure_buffers``) sets
# ``op_offload`` to this. llama.cpp's default is on: its scheduler then runs the matrix product
# of a weight held in host memory on the GPU when the batch is large enough (CUDA: 32 tokens or
# more), copying the weight into the GPU's compute buffer. On a split that puts the host
# layers' and the output layer's weights, and the logits, in device memory the memory model
# gives to the host (``core.estimate``'s ``gpu`` rules, ``MemoryModel.device_compute_bytes``):
# a request admitted to a split worker could then fail to allocate. Off, what a split holds on
# the device is what was planned; the cost is a slower prefill of the host layers on a real GPU.
# A build without a GPU backend (this machine's, the ``sim`` device's) is not affected.
OP_OFFLOAD = False


def amx_in_cpu_backend(system_info: str) -> bool:
    """Whether llama.cpp's CPU backend would use AMX (``llama_print_system_info``'s text)."""
    return "AMX_INT8 = 1" in system_info


def _system_info() -> str:
    import llama_cpp.llama_cpp as lib

    return str(lib.llama_print_system_info().decode("utf-8", "replace"))


@functools.cache
def cpu_backend_repacks() -> bool:
    """Whether models loaded here get the CPU backend's repacked weights (its ``REPACK`` extra
    buffer type: the memory model's repack rules, ``engine.gguf_meta``): a build with it, on a
    CPU without AMX (where models load without extra buffer types, above)."""
    info = _system_info()
    return "REPACK = 1" in info and not amx_in_cpu_backend(info)


def repack_rules_for(system_info: str) -> dict[str, int]:
    """The weight types the CPU backend repacks, with the rows each needs to divide
    (``engine.gguf_meta``'s tables), on a CPU whose ``llama_print_system_info`` is this text:
    Q2_K only with AVX-512."""
    from spillover.engine.gguf_meta import AVX512_REPACK_TYPES, CPU_REPACK_TYPES

    return CPU_REPACK_TYPES | (AVX512_REPACK_TYPES if "AVX512 = 1" in system_info else {})


@functools.cache
def cpu_repack_rules() -> dict[str, int]:
    """``repack_rules_for`` this machine (whether or not its models get repacked at all:
    ``cpu_backend_repacks``)."""
    return repack_rules_for(_system_info())


@functools.cache
def load_llama_cpp() -> ModuleType:
    """The ``llama_cpp`` package, its model defaults set for this machine's CPU (above)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    if amx_in_cpu_backend(_system_info()):
        defaults = lib.llama_model_default_params

        def without_extra_buffers() -> object:
            params = defaults()
            params.use_extra_bufts = False
            return params

        # Llama() calls it through the bindings' module; spillover's loads through the package
        lib.llama_model_default_params = without_extra_buffers
        llama_cpp.llama_model_default_params = without_extra_buffers
    return llama_cpp
