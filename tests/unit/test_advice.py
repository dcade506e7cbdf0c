"""The advisor's rules on recorded measurements: what it recommends, with which predicted gain, and silence
when nothing is wrong."""

import pytest

from lightning_ciuic.advice import RANK_FIELDS, RunProfile, advise, check, compression_speedups
from lightning_ciuic.comm.auto import AutoDecision
from lightning_ciuic.wire.codecs import dense_codec

CODEC = {"none": 0.0, "fp16": 2e-9, "int8": 8e-9, "nf4": 3e-8}


def _rank(**values):
    base = dict.fromkeys(RANK_FIELDS, 0.0)
    base.update(step=0.2, compute=0.15, dp_comm=0.06, dp_exposed=0.03, dp_payload=4e7, dp_bytes=4e7)
    base.update(values)
    return base


def _profile(ranks, **kwargs):
    settings = dict(world_size=len(ranks), dp=len(ranks), gradient_numel=10_000_000, buckets=2, latency_s=1e-4,
                    bandwidth_bytes_per_s=1.2e10, codec_s_per_value=CODEC, ranks=ranks)
    settings.update(kwargs)
    return RunProfile(**settings)


def test_a_healthy_run_gets_no_advice():
    assert advise(_profile([_rank(), _rank()])) == []


def test_slow_link_sync_dominated_step_recommends_compression_with_its_predicted_gain():
    # 1 Gbit/s link, 40 MB of gradients: sync 0.32 s of a 0.47 s step, 0.3 s of it exposed.
    ranks = [_rank(step=0.47, compute=0.15, dp_comm=0.32, dp_exposed=0.30) for _ in range(2)]
    profile = _profile(ranks, bandwidth_bytes_per_s=1.25e8)
    (advice,) = [a for a in advise(profile) if a.rule == "compression"]
    assert "communication_compression" in advice.argument
    # The prediction worked by hand: a mode's sync time U = latency per message + wire bytes over the link + codec
    # time (2 ranks: a ring sends each byte once; dense modes run one all-reduce per bucket, quantized ones an
    # all-to-all and an all-gather); backward hid U(none) - exposed of the measured sync, and hides as much of any
    # other mode's; the step keeps its compute and adds what is left exposed.
    numel, buckets, latency, link = 10_000_000, 2, 1e-4, 1.25e8
    wire = {"none": 4 * numel, "fp16": 2 * numel, **{m: dense_codec(m).nbytes(numel) for m in ("int8", "nf4")}}
    messages = {"none": 2 * buckets, "fp16": 2 * buckets, "int8": 4 * buckets, "nf4": 4 * buckets}
    sync = {m: messages[m] * latency + wire[m] / link + CODEC[m] * numel for m in wire}
    hidden = sync["none"] - 0.30
    speedup = {m: 0.47 / (0.47 - 0.30 + max(0.0, sync[m] - hidden)) for m in sync}
    best = max(speedup, key=speedup.get)
    assert best == "int8" and f"communication_compression: {best}" in advice.argument
    assert advice.predicted_speedup == pytest.approx(speedup["int8"])
    assert compression_speedups(profile) == pytest.approx(speedup)
    assert speedup["int8"] > speedup["fp16"] > 1.3


def test_diloco_is_advised_when_even_compression_leaves_the_step_sync_bound_and_says_what_it_costs():
    # The slow-link run above: int8 is predicted about 1.5x, DiLoCo (the exposed sync removed, one uncompressed sync
    # of the model every 32 steps) about 2.6x.
    ranks = [_rank(step=0.47, compute=0.15, dp_comm=0.32, dp_exposed=0.30) for _ in range(2)]
    profile = _profile(ranks, bandwidth_bytes_per_s=1.25e8)
    sync_none = 2 * 2 * 1e-4 + 4 * 10_000_000 / 1.25e8
    expected = 0.47 / (0.47 - 0.30 + sync_none / 32)
    (advice,) = [a for a in advise(profile) if a.rule == "diloco"]
    assert advice.predicted_speedup == pytest.approx(expected) and expected > 1.1 * max(compression_speedups(profile).values())
    assert "sync_every: 32, outer_lr: 1.0, outer_momentum: 0.0" in advice.argument and "changes the optimisation" in advice.summary
    assert advise(profile)[0] == advice  # largest predicted gain first
    # Where compression gets most of the way, DiLoCo's change of optimisation is not worth advising.
    # 2 Gbit/s, most of the sync hidden: fp16 is predicted about 1.18x, DiLoCo about 1.19x, below its 1.25x.
    ranks = [_rank(step=0.40, compute=0.30, dp_comm=0.16, dp_exposed=0.07) for _ in range(2)]
    profile = _profile(ranks, bandwidth_bytes_per_s=2.5e8)
    finding = next(f for f in check(profile) if f.rule == "DiLoCo")
    assert finding.advice is None and "advised from 1.25x and 1.1x the compression's gain" in finding.checked
    assert [a.rule for a in advise(profile)] == ["compression"]
    already = _profile([_rank(step=0.47, dp_exposed=0.30) for _ in range(2)], bandwidth_bytes_per_s=1.25e8, compression="diloco-none")
    assert not [a for a in advise(already) if a.rule in ("diloco", "compression")]


def test_auto_says_when_diloco_would_pay_and_stays_silent_otherwise():
    slow = AutoDecision("int8", 1e-4, 1.25e8, predicted_s={"none": 0.32, "int8": 0.16}, measured_s={"none": 0.47, "int8": 0.30})
    assert slow.diloco_speedup() == pytest.approx(0.30 / (0.30 - 0.16 + 0.32 / 32))
    assert "DiLoCo(sync_every=32) would pay" in slow.reason and "never picks it" in slow.reason
    fast = AutoDecision("none", 1e-5, 5e9, predicted_s={"none": 0.004}, measured_s={"none": 0.2})
    assert "DiLoCo" not in fast.reason


def test_fast_link_does_not_recommend_compression():
    profile = _profile([_rank(step=0.2, dp_comm=0.01, dp_exposed=0.002) for _ in range(2)], bandwidth_bytes_per_s=5e9)
    assert not [a for a in advise(profile) if a.rule == "compression"]


def test_straggler_is_named_with_the_balanced_prediction():
    ranks = [_rank(compute=0.1, step=0.25), _rank(compute=0.1, step=0.25), _rank(compute=0.1, step=0.25),
             _rank(compute=0.2, step=0.25, dp_exposed=0.0)]
    (advice,) = [a for a in advise(_profile(ranks)) if a.rule == "straggler"]
    assert advice.summary.startswith("rank 3 is 2.00x slower than the others") and "DynamicDataBalancer" in advice.argument
    balanced = 4 / (3 / 0.1 + 1 / 0.2)
    assert advice.predicted_speedup == pytest.approx(0.25 / (0.25 - (0.2 - balanced)))


def test_straggler_under_tensor_parallel_names_every_rank_of_the_slow_replica():
    ranks = [_rank(compute=0.1), _rank(compute=0.1), _rank(compute=0.25), _rank(compute=0.12)]
    profile = _profile(ranks, dp=2, tp=2, dp_rank_of=[0, 0, 1, 1])
    (advice,) = [a for a in advise(profile) if a.rule == "straggler"]
    assert advice.summary.startswith("rank 2, 3 is 2.50x slower")


def test_data_loading_and_pipeline_bubble_rules():
    profile = _profile([_rank(step=0.3, data_wait=0.1) for _ in range(2)])
    assert [a.rule for a in advise(profile)] == ["data"]
    assert advise(profile)[0].predicted_speedup == pytest.approx(1.5)
    bubble = _profile([_rank() for _ in range(2)], pp=4, bubble=3 / 7, num_microbatches=4)
    (advice,) = advise(bubble)
    assert advice.rule == "bubble" and advice.argument == "strategy.num_microbatches: 8"
    assert advice.predicted_speedup == pytest.approx((1 - 3 / 11) / (1 - 3 / 7))


def test_profile_round_trips_through_json():
    profile = _profile([_rank(), _rank()])
    assert RunProfile.from_json(profile.to_json()) == profile


def test_tight_memory_recommends_sharding_with_the_memory_it_frees():
    # 4 replicas each holding 1600 MB of parameters, gradients and Adam state, peaking at 7.5 of 8 GB.
    tight = _profile([_rank(memory_mb=7500.0) for _ in range(4)], memory_capacity_mb=8000.0, model_state_mb=1600.0)
    (advice,) = [a for a in advise(tight) if a.rule == "sharding"]
    assert "data_parallel_shard_size: 4" in advice.argument
    assert advice.predicted_memory_mb == pytest.approx(1600.0 * 3 / 4)  # it keeps a quarter
    assert "1200 MB less memory per rank" in str(advice)
    # The all-gathers it adds: every parameter gathered for forward and backward, 2 (4-1)/4 of 40 MB (float32).
    assert f"{2 * 3 / 4 * 10_000_000 * 4 / 2**20:.0f} MB more traffic" in advice.summary
    roomy = _profile([_rank(memory_mb=3000.0) for _ in range(4)], memory_capacity_mb=8000.0, model_state_mb=1600.0)
    assert not [a for a in advise(roomy) if a.rule == "sharding"]
    already = _profile([_rank(memory_mb=7500.0) for _ in range(4)], memory_capacity_mb=8000.0, model_state_mb=1600.0, dp_shard=4)
    assert advise(already) == []


def test_sharded_runs_get_no_all_reduce_compression_advice():
    # The slow-link profile that recommends compression when replicated (above), sharded instead.
    ranks = [_rank(step=0.47, compute=0.15, dp_comm=0.32, dp_exposed=0.30) for _ in range(2)]
    assert advise(_profile(ranks, bandwidth_bytes_per_s=1.25e8))
    assert advise(_profile(ranks, bandwidth_bytes_per_s=1.25e8, dp_shard=2)) == []


def test_monitor_json_of_earlier_versions_still_reads():
    old = _profile([_rank(), _rank()]).to_json()
    for rank in old["ranks"]:
        del rank["dp_gather"], rank["dp_scatter"]
    for key in ("dp_shard", "model_state_mb", "memory_capacity_mb"):
        del old[key]
    profile = RunProfile.from_json(old)
    assert profile.dp_shard == 1 and profile.mean("dp_gather") == 0.0 and advise(profile) == []


def test_expert_balance_is_a_finding_with_the_worst_layer_and_the_busiest_rank():
    from lightning_ciuic.advice import RunProfile, check
    from lightning_ciuic.advice.profile import RANK_FIELDS

    ranks = [dict.fromkeys(RANK_FIELDS, 0.0) | {"step": 0.1, "compute": 0.1, "ep_tokens": t} for t in (300.0, 100.0)]
    profile = RunProfile(world_size=2, dp=2, ep=2, ranks=ranks, expert_load={"layers.1.experts": 1.2, "layers.2.experts": 2.5})
    (finding,) = [f for f in check(profile) if f.rule == "expert balance"]
    assert "max/mean 2.50 in layers.2.experts" in finding.checked and "ran max/mean 1.50x the tokens" in finding.checked
    assert "add ExpertLoadBalancer" in finding.checked and finding.advice is None  # no speed-up is predicted
    balanced = RunProfile(world_size=2, dp=2, ep=2, ranks=ranks, expert_load={"layers.1.experts": 1.2})
    (finding,) = [f for f in check(balanced) if f.rule == "expert balance"]
    assert "ExpertLoadBalancer" not in finding.checked


def test_expert_imbalance_that_costs_all_to_all_waiting_is_advice_with_the_wait_removed():
    from lightning_ciuic.advice import RunProfile, check
    from lightning_ciuic.advice.profile import RANK_FIELDS

    def profile(waits, load=2.5):
        ranks = [
            dict.fromkeys(RANK_FIELDS, 0.0) | {"step": 0.1, "compute": 0.1, "ep_tokens": t, "ep_comm": w}
            for t, w in zip((300.0, 100.0), waits)
        ]
        (finding,) = [f for f in check(RunProfile(world_size=2, dp=2, ep=2, ranks=ranks, expert_load={"l": load})) if f.rule == "expert balance"]
        return finding

    waited = profile((0.002, 0.022))  # the rank with fewer tokens waits 20 ms of a 100 ms step for the busier one
    assert "all-to-alls 2.0-22.0 ms per step" in waited.checked
    assert waited.advice is not None and waited.advice.predicted_speedup == pytest.approx(0.1 / 0.08)
    assert "ExpertLoadBalancer" in waited.advice.argument
    assert profile((0.010, 0.012)).advice is None  # 2 ms of 100: below 5% of the step, no prediction
    assert profile((0.002, 0.022), load=1.2).advice is None  # balanced experts: nothing to advise


def test_expert_imbalance_compares_the_ranks_of_one_pipeline_stage_and_knows_the_balancer_is_on():
    """Under pipeline parallelism ranks of different stages run different layers: their all-to-alls' seconds differ
    without any imbalance (DualPipeV's rank 0 holds the embedding's and the head's stages). With ExpertLoadBalancer
    already in the run, the advice is to raise its rate, not to add it."""
    from lightning_ciuic.advice import RunProfile, check
    from lightning_ciuic.advice.profile import RANK_FIELDS

    def finding(waits, pp_rank_of, rate=None, tokens=(300.0, 300.0, 100.0, 100.0)):
        ranks = [
            dict.fromkeys(RANK_FIELDS, 0.0) | {"step": 0.1, "compute": 0.1, "ep_tokens": t, "ep_comm": w}
            for t, w in zip(tokens, waits)
        ]
        profile = RunProfile(
            world_size=4, dp=2, pp=2, ep=2, ranks=ranks, expert_load={"l": 2.5}, pp_rank_of=pp_rank_of,
            expert_balancer_rate=rate,
        )
        (found,) = [f for f in check(profile) if f.rule == "expert balance"]
        return found

    stages_apart = finding((0.002, 0.002, 0.030, 0.030), [0, 0, 1, 1])
    assert stages_apart.advice is None and "compared within each pipeline stage" in stages_apart.checked
    assert "ran max/mean 1.00x the tokens" in stages_apart.checked  # 300 and 100 a rank: the stages' layers differ
    assert "ran max/mean 1.50x the tokens" in finding((0.002, 0.002, 0.030, 0.030), []).checked
    assert finding((0.002, 0.002, 0.030, 0.030), []).advice is not None  # stages unknown: one stage, as before
    within = finding((0.002, 0.002, 0.010, 0.030), [0, 0, 1, 1])
    assert within.advice.predicted_speedup == pytest.approx(0.1 / 0.08)
    assert "callbacks: [ExpertLoadBalancer()]" in within.advice.argument
    on = finding((0.002, 0.002, 0.010, 0.030), [0, 0, 1, 1], rate=1e-3)
    assert "bias_update_rate=0.01" in on.advice.argument and "ExpertLoadBalancer on" in on.advice.summary
    assert "raise its rate" in on.checked and "add ExpertLoadBalancer" not in on.checked
