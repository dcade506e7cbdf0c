"""The shared argument checks: one wording, booleans are not integers, alternatives named."""

import pytest

from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.validation import check_choice, check_int


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (0, {}, "n must be an integer >= 1, got 0."),
        (True, {}, "n must be an integer >= 1, got True."),
        (2.0, {}, "n must be an integer >= 1, got 2.0."),
        (-1, {"minimum": 0}, "n must be an integer >= 0, got -1."),
        ("many", {"allowed": ("auto",)}, "n must be an integer >= 1 or 'auto', got 'many'."),
        (0, {"allowed": (None,), "note": "steps"}, "n must be an integer >= 1 or None (steps), got 0."),
    ],
)
def test_check_int_names_what_was_given_and_what_would_work(value, kwargs, message):
    with pytest.raises(ValueError) as error:
        check_int("n", value, **kwargs)
    assert str(error.value) == message


def test_check_int_accepts_integers_and_the_allowed_alternatives():
    check_int("n", 1)
    check_int("n", 0, minimum=0)
    check_int("n", None, allowed=(None,))
    check_int("n", "auto", allowed=("auto",))


def test_check_choice():
    check_choice("mode", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"^mode='c' is not one of 'a', 'b'\.$"):
        check_choice("mode", "c", ("a", "b"))


def test_local_tensor_passes_plain_tensors_and_none_through():
    import torch

    t = torch.ones(2)
    assert local_tensor(t) is t and local_tensor(None) is None
