"""Stand-in for SGLang's `sgl_kernel` on a CPU without AMX (installed by tools/sglang-cpu/install.sh).

No CPU build of sgl-kernel is on PyPI. SGLang 0.5.23's CPU path imports these names at module load
and, with `--attention-backend torch_native` on a CPU without AMX, never calls them in plain
decoding; each raises if it ever is, naming the kernel, so nothing is silently skipped."""

__version__ = "0.0.0+ridgeline.cpu.stub"

NAMES = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
         "assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
         "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu")


def _missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: this is Ridgeline's CPU stand-in for sgl-kernel; the call "
                                  "needs the real sglang-kernel-cpu build (an AMX CPU, or speculative decoding)")
    kernel.__name__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _missing(_name)
