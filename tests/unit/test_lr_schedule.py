import math

import pytest
import torch

from lightning_ciuic import WarmupCosineAnnealingLR, WarmupCosineSchedule, warmup_cosine_lr


def test_boundaries_of_the_three_phases():
    base, floor, warmup, total = 1.0, 0.01, 8, 100
    assert warmup_cosine_lr(0, base, warmup, total, floor) == pytest.approx(base / warmup)
    assert warmup_cosine_lr(warmup - 1, base, warmup, total, floor) == pytest.approx(base)
    assert warmup_cosine_lr(warmup, base, warmup, total, floor) == pytest.approx(base)
    midpoint = warmup + (total - warmup) // 2
    assert warmup_cosine_lr(midpoint, base, warmup, total, floor) == pytest.approx((base + floor) / 2)
    assert warmup_cosine_lr(total - 1, base, warmup, total, floor) == pytest.approx(
        floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * (total - 1 - warmup) / (total - warmup)))
    )
    assert warmup_cosine_lr(total, base, warmup, total, floor) == floor
    assert warmup_cosine_lr(10 * total, base, warmup, total, floor) == floor


def test_no_warmup_starts_at_peak():
    assert warmup_cosine_lr(0, 0.5, 0, 10, 0.0) == pytest.approx(0.5)


def test_monotone_up_then_down():
    lrs = [warmup_cosine_lr(t, 1.0, 10, 50, 0.0) for t in range(50)]
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def _optimizer(lr=0.1, groups=1):
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr)


def test_scheduler_follows_the_function_and_resumes_exactly():
    opt = _optimizer()
    sched = WarmupCosineAnnealingLR(opt, warmup_steps=3, max_steps=20, min_lr=0.001)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([warmup_cosine_lr(t, 0.1, 3, 20, 0.001) for t in range(10)])

    state, opt_state = sched.state_dict(), opt.state_dict()
    opt2 = _optimizer(lr=123.0)
    opt2.load_state_dict(opt_state)
    sched2 = WarmupCosineAnnealingLR(opt2, warmup_steps=3, max_steps=20, min_lr=0.001)
    sched2.load_state_dict(state)
    for _ in range(5):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_per_group_floors():
    opt = _optimizer(groups=2)
    sched = WarmupCosineAnnealingLR(opt, warmup_steps=0, max_steps=2, min_lr=[0.0, 0.05])
    opt.step(), sched.step(), opt.step(), sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0, 0.05])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_steps": 10, "max_steps": 10}, r"warmup_steps=10 is not shorter than training \(max_steps=10\).*e\.g\. 0"),
        ({"warmup_steps": 50, "max_steps": 20}, r"warmup_steps=50 is not shorter than training"),
        ({"warmup_steps": -1, "max_steps": 20}, "warmup_steps must be an integer >= 0, got -1"),
        ({"warmup_steps": 0, "max_steps": 0}, "max_steps must be an integer >= 1, got 0"),
        ({"warmup_steps": 0, "max_steps": 5, "min_lr": -1.0}, "min_lr must be >= 0"),
        ({"warmup_steps": 0, "max_steps": 5, "min_lr": [0.0, 0.0]}, "min_lr has 2 values but the optimizer has 1"),
    ],
)
def test_bad_schedule_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosineAnnealingLR(_optimizer(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\), got 1.0"),
        ({"min_lr_ratio": 2.0}, r"min_lr_ratio must be in \[0, 1\], got 2.0"),
        ({"scale_lr_with_batch": "sqrt"}, "scale_lr_with_batch='sqrt'; use 'none' or 'linear'"),
        ({"scale_lr_with_batch": "linear"}, "needs reference_batch_size >= 1"),
    ],
)
def test_bad_callback_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosineSchedule(**kwargs)
