"""Which pipeline ranks read the training data (lightning_ciuic/data/stages.py). The reads of real runs are counted
by tests/integration/test_data_loaders.py::test_middle_pipeline_stages_read_no_data_and_the_ends_read_each_sample_once.
"""

import pytest
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader, TensorDataset

from lightning_ciuic.data.check import batch_digest
from lightning_ciuic.data.stages import NotRead, StageLoader, roles, stage_loader


@pytest.mark.parametrize(
    "pp, per_rank, schedule, expected",
    [
        (2, 1, "1f1b", ["first", "last"]),  # no middle stage: loaders left as they are
        (3, 1, "gpipe", ["first", "middle", "last"]),
        (4, 1, "1f1b", ["first", "middle", "middle", "last"]),
        (2, 2, "interleaved_1f1b", ["first", "last"]),  # rank 0: stages 0, 2; rank 1: 1, 3 (the last)
        (3, 2, "looped_bfs", ["first", "middle", "last"]),
        (2, 2, "zbv_zero_bubble", ["first", "middle"]),  # V: rank 0 holds stages 0 and 3
        (3, 2, "dualpipev", ["first", "middle", "middle"]),
    ],
)
def test_the_ranks_holding_the_first_and_the_last_stage_read_the_others_are_middle(pp, per_rank, schedule, expected):
    assert roles(pp, per_rank, schedule) == expected


def test_without_a_pipeline_the_loader_is_returned_as_it_is():
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert stage_loader(loader, None, None) is loader


def test_a_not_read_batch_answers_for_the_inputs_shape_only():
    batch = NotRead((4, 16))
    assert batch[0] is batch and batch["input_ids"] is batch  # pipeline_inputs(batch) and dict batches
    assert batch.shape == torch.Size([4, 16]) and batch.size() == torch.Size([4, 16]) and batch.size(1) == 16
    assert batch.numel() == 64 and batch.dim() == 2 and batch.batch_size == 4
    with pytest.raises(TypeError):
        iter(batch)
    with pytest.raises(TypeError):
        batch + 1
    assert batch_digest(batch) == batch_digest(NotRead((2, 3)))  # its digest is never compared (data/check.py)
    with pytest.raises(Exception):  # Lightning cannot size it: pipelined_loss gives Lightning its batch size
        extract_batch_size(batch)
    from lightning_ciuic.telemetry import samples_in  # and the callbacks that count samples read it from the batch

    assert samples_in(batch) == 4 and samples_in((torch.zeros(3, 16), torch.zeros(3, 16))) == 3


def test_a_stage_loader_is_the_wrapped_loaders_length_and_attributes_read_and_set(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_global_rank", lambda group, rank: rank)  # no process group needed
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    wrapped = StageLoader(loader, "middle", object(), torch.device("cpu"), None)
    assert len(wrapped) == 3 and wrapped.batch_size == 2 and wrapped.sampler is loader.sampler
    wrapped.worker_init_fn = print  # as Lightning's _auto_add_worker_init_fn does
    assert loader.worker_init_fn is print and "worker_init_fn" not in vars(wrapped)
