"""The test harness itself: tiny real DeepSpeed engines train bit-deterministically."""

from tools.engines import batches, build_engine, destroy_engine, train


def test_same_seed_engines_give_identical_losses():
    bl = batches(3)
    runs = []
    for _ in range(2):
        eng = build_engine("llama", zero_stage=2, dtype="bf16", seed=0)
        runs.append(train(eng, bl))
        destroy_engine(eng)
    assert runs[0] == runs[1]
    assert all(loss == loss for loss in runs[0])  # no NaN


def test_a_bench_scripts_jit_built_ops_go_to_the_checkouts_own_folder_not_the_shared_cache(tmp_path):
    # A job killed while building an op leaves a lock in ~/.cache/torch_extensions that stalls
    # every later build there (issue 54): the suite and every script of tools/ build in their own.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tools.engines import own_torch_extensions_dir

    assert os.environ["TORCH_EXTENSIONS_DIR"] == own_torch_extensions_dir()  # the suite's (conftest)
    root = Path(__file__).resolve().parents[1]
    script = (
        "from tools.engines import setup_single_process_env; setup_single_process_env(); "
        "from torch.utils.cpp_extension import _get_build_directory; "
        "print(_get_build_directory('fused_adam', verbose=False))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["HOME"] = str(tmp_path)  # where a shared cache, and its stale lock, would be
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert Path(out.strip()) == Path(own_torch_extensions_dir()) / "fused_adam"


def test_deepspeeds_op_builders_get_py_cpuinfos_own_answer_from_the_checkouts_file():
    # DeepSpeed's CPU op builders ask py-cpuinfo (cpuinfo.get_cpu_info, looked up at each call)
    # for the compile flags of every op they load; the harness answers from a file instead of
    # py-cpuinfo's fresh process each time (tools.engines.remember_cpu_info): the answer must be
    # the one py-cpuinfo gives.
    import cpuinfo

    assert cpuinfo.get_cpu_info.remembered
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info.asked()
