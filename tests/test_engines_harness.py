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
