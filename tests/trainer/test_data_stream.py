from sorl_megatron.trainer.rl_loop import DataStream


def test_batches_cover_each_epoch_once_and_are_deterministic():
    ds = DataStream(list(range(10, 17)), batch_size=3, seed=5)  # 7 prompts: batches straddle epochs
    seen = [i for step in range(7) for i in ds.batch(step)]  # 21 draws = 3 epochs
    for epoch in range(3):
        assert sorted(seen[epoch * 7:(epoch + 1) * 7]) == list(range(10, 17))
    assert seen[:7] != seen[7:14]  # a new permutation per epoch
    assert DataStream(list(range(10, 17)), 3, seed=5).batch(4) == ds.batch(4)  # a function of the step (resume)
    assert DataStream(list(range(10, 17)), 3, seed=5, shuffle=False).batch(3) == [12, 13, 14]
