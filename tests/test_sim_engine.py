"""Scheduler (pure) and engine (asyncio) behaviour: batching, preemption, latency model."""

from __future__ import annotations

import asyncio

import pytest

from vllm_sim.config import CostModel, make_config
from vllm_sim.engine import Engine, GenerationParams
from vllm_sim.errors import BadRequestError, SimConfigError
from vllm_sim.prefix_cache import hash_blocks, hash_seed
from vllm_sim.scheduler import Scheduler, SeqStatus, Sequence, new_sequence

FAST = 1e6  # time_scale: sleeps shrink to ~nothing, simulated latencies are unchanged


def seq(rid: str, prompt_len: int, out_len: int, *, start: int = 0) -> Sequence:
    prompt = list(range(start, start + prompt_len))
    output = list(range(10**6, 10**6 + out_len))
    return new_sequence(
        request_id=rid,
        prompt=prompt,
        output=output,
        finish_reason="length",
        arrival_time=0.0,
        hashes=hash_blocks(prompt + output, block_size=16, seed=hash_seed("m", None)),
    )


def test_cost_model_is_linear_in_its_inputs() -> None:
    cost = CostModel(
        step_overhead_s=0.01,
        prefill_tokens_per_s=1000.0,
        decode_step_s=0.002,
        decode_s_per_seq=0.001,
        attention_s_per_token=1e-6,
    )
    assert cost.step_seconds(prefill_tokens=500, decode_seqs=0, context_tokens=0) == 0.51
    assert cost.step_seconds(prefill_tokens=0, decode_seqs=3, context_tokens=1000) == (
        pytest.approx(0.01 + 0.002 + 0.003 + 0.001)
    )


def test_profiles_match_reference_hardware() -> None:
    big = make_config("llama-3.1-70b-8xh100")
    cold_8k = big.cost.step_seconds(prefill_tokens=8192, decode_seqs=0, context_tokens=8192)
    assert 0.35 < cold_8k < 0.5
    one_decode = big.cost.step_seconds(prefill_tokens=0, decode_seqs=1, context_tokens=2000)
    assert 0.018 < one_decode < 0.025
    assert big.num_gpu_blocks * big.block_size == pytest.approx(1.3e6, rel=0.01)
    small = make_config("llama-3.1-8b-1xh100", prefill_tokens_per_s=25_000)
    assert small.cost.prefill_tokens_per_s == 25_000
    assert small.num_gpu_blocks * small.block_size == pytest.approx(0.4e6, rel=0.01)
    with pytest.raises(SimConfigError):
        make_config("no-such-profile")
    with pytest.raises(SimConfigError):
        make_config(time_scale=0)
    with pytest.raises(SimConfigError):
        make_config(blocksize=16)


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=8192))
    s = seq("a", 10_000, 2)
    scheduler.add(s)
    plan = scheduler.schedule(0.0)
    assert (plan.prefill_tokens, plan.decode_seqs) == (8192, 0)
    assert not scheduler.complete(plan, 1.0).progressed  # mid-prefill: no token yet
    plan = scheduler.schedule(1.0)
    assert plan.prefill_tokens == 10_000 - 8192
    assert scheduler.complete(plan, 2.0).progressed == (s,)
    assert s.first_token_time == 2.0
    plan = scheduler.schedule(2.0)
    assert (plan.prefill_tokens, plan.decode_seqs) == (0, 1)
    assert scheduler.complete(plan, 3.0).finished == (s,)
    assert scheduler.stats.finished == {"length": 1}
    assert scheduler.stats.ttft.total == 2.0 and scheduler.stats.e2e.total == 3.0


def test_running_first_then_waiting_fcfs_within_max_num_seqs() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=2, max_num_batched_tokens=100))
    seqs = [seq(f"r{i}", 30, 5, start=1000 * i) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule(0.0)
    assert [s.request_id for s, _ in plan.work] == ["r0", "r1"]
    scheduler.complete(plan, 0.1)
    plan = scheduler.schedule(0.1)
    assert [(s.request_id, n) for s, n in plan.work] == [("r0", 1), ("r1", 1)]
    assert list(scheduler.waiting) == seqs[2:]


def test_preemption_when_blocks_run_out() -> None:
    # 4 blocks of 16; each sequence grows to 16 + 40 tokens = 4 blocks: both cannot run.
    scheduler = Scheduler(make_config(num_gpu_blocks=4, block_size=16))
    a, b = seq("a", 16, 40), seq("b", 16, 40, start=500)
    scheduler.add(a)
    scheduler.add(b)
    now, steps = 0.0, 0
    preempted: list[str] = []
    while scheduler.has_work and steps < 500:
        plan = scheduler.schedule(now)
        preempted += [s.request_id for s in plan.preempted]
        now += 0.01
        scheduler.complete(plan, now)
        steps += 1
    assert a.status is SeqStatus.FINISHED and b.status is SeqStatus.FINISHED
    assert preempted and preempted[0] == "b"  # the newest running sequence goes first
    assert scheduler.stats.preemptions == len(preempted)
    assert scheduler.stats.generation_tokens == 80
    assert scheduler.stats.prefix_cache_queries == 32  # a recompute is not a new query
    assert scheduler.cache.num_free == 4


def test_abort_releases_blocks_even_mid_step() -> None:
    scheduler = Scheduler(make_config(num_gpu_blocks=8))
    s = seq("a", 40, 10)
    scheduler.add(s)
    plan = scheduler.schedule(0.0)
    assert scheduler.cache.num_free == 5
    assert scheduler.abort(s)
    assert scheduler.cache.num_free == 8
    assert scheduler.complete(plan, 1.0).progressed == ()
    assert scheduler.stats.finished == {"abort": 1}
    assert not scheduler.abort(s)


def prompt_of(n_tokens: int, salt: int = 0) -> list[int]:
    return [salt * 10**7 + i for i in range(n_tokens)]


async def run(engine: Engine, params: GenerationParams) -> Sequence:
    handle = engine.submit(params)
    await handle.wait_done()
    return handle.seq


async def test_repeated_prompt_ttft_drops_by_the_cached_share() -> None:
    config = make_config(time_scale=FAST)
    engine = Engine(config)
    engine.start()
    try:
        cost = config.cost
        params = GenerationParams(prompt=prompt_of(8000), max_tokens=4, ignore_eos=True)
        cold = await run(engine, params)
        warm = await run(engine, params)
        ttft_cold = cold.first_token_time - cold.arrival_time  # type: ignore[operator]
        ttft_warm = warm.first_token_time - warm.arrival_time  # type: ignore[operator]
        assert warm.cached_tokens == 7984  # floor(7999 / 16) * 16
        assert ttft_cold == pytest.approx(
            cost.step_overhead_s
            + 8000 / cost.prefill_tokens_per_s
            + 8000 * cost.attention_s_per_token
        )
        assert ttft_warm == pytest.approx(
            cost.step_overhead_s
            + 16 / cost.prefill_tokens_per_s
            + 8000 * cost.attention_s_per_token
        )
        assert ttft_warm < 0.1 * ttft_cold
    finally:
        await engine.stop()


async def test_reported_latency_does_not_depend_on_time_scale() -> None:
    ttfts = []
    for scale in (1e3, 1e6):
        engine = Engine(make_config(time_scale=scale))
        engine.start()
        try:
            s = await run(
                engine, GenerationParams(prompt=prompt_of(3000), max_tokens=3, ignore_eos=True)
            )
            ttfts.append(
                (
                    s.first_token_time - s.arrival_time,  # type: ignore[operator]
                    s.finish_time - s.arrival_time,
                )
            )  # type: ignore[operator]
        finally:
            await engine.stop()
    assert ttfts[0] == pytest.approx(ttfts[1])


async def test_ttft_grows_when_the_instance_is_saturated() -> None:
    engine = Engine(make_config(time_scale=FAST))
    engine.start()
    try:
        alone = await run(engine, GenerationParams(prompt=prompt_of(6000, 99), max_tokens=2))
        single = alone.first_token_time - alone.arrival_time  # type: ignore[operator]
        handles = [
            engine.submit(GenerationParams(prompt=prompt_of(6000, i), max_tokens=2))
            for i in range(12)
        ]
        await asyncio.gather(*(h.wait_done() for h in handles))
        ttfts = [h.seq.first_token_time - h.seq.arrival_time for h in handles]  # type: ignore
        assert ttfts == sorted(ttfts)  # FCFS: later arrivals wait longer
        # The first shares its step with a chunk of the second (chunked prefill fills 8192).
        assert single < ttfts[0] < 1.5 * single
        assert ttfts[-1] > 8 * single  # the budget fits ~one 6k prompt per step
        assert engine.stats.ttft.count == 13
    finally:
        await engine.stop()


async def test_output_length_and_text_are_deterministic() -> None:
    engine = Engine(make_config(time_scale=FAST))
    engine.start()
    try:
        exact = await run(
            engine, GenerationParams(prompt=prompt_of(50), max_tokens=37, ignore_eos=True)
        )
        assert exact.num_output == 37 and exact.finish_reason == "length"
        lengths = set()
        for salt in range(12):
            params = GenerationParams(prompt=prompt_of(50, salt), max_tokens=40)
            first, second = await run(engine, params), await run(engine, params)
            assert 1 <= first.num_output <= 40
            assert first.tokens == second.tokens
            assert first.finish_reason == ("length" if first.num_output == 40 else "stop")
            lengths.add(first.num_output)
        assert len(lengths) > 3  # early stops vary with the prompt
    finally:
        await engine.stop()


async def test_requests_longer_than_the_context_are_refused() -> None:
    engine = Engine(make_config(num_gpu_blocks=10, block_size=16, time_scale=FAST))
    engine.start()
    try:
        with pytest.raises(BadRequestError):  # 150 + 11 tokens: one past the 160-token pool
            engine.submit(GenerationParams(prompt=prompt_of(150), max_tokens=11))
        # Exactly the pool: accepted and generated to the end in the blocks there are.
        fits = await run(
            engine, GenerationParams(prompt=prompt_of(150), max_tokens=10, ignore_eos=True)
        )
        assert fits.num_output == 10 and fits.finish_reason == "length"
    finally:
        await engine.stop()


async def test_pause_freezes_progress_and_stop_aborts() -> None:
    engine = Engine(make_config(time_scale=1e4))
    engine.start()
    handle = engine.submit(
        GenerationParams(prompt=prompt_of(100), max_tokens=1000, ignore_eos=True)
    )
    await handle.wait(2)
    engine.pause()
    await asyncio.sleep(0.01)
    frozen = handle.num_output
    await asyncio.sleep(0.05)
    assert handle.num_output == frozen and not handle.done
    engine.resume()
    await handle.wait(frozen)
    assert handle.num_output > frozen
    await engine.stop()
    assert handle.aborted and engine.scheduler.cache.num_free == engine.config.num_gpu_blocks
