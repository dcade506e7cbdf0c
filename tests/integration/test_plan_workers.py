"""Planning leaves this process's ``sys.excepthook`` as it found it."""

import functools
import sys

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.pipeline_module import PipelineConfig
from lightning_ciuic.planner import plan_layout
from lightning_ciuic.planner.config import optimizers_of
from tests.integration.test_plan import _deep_llama

# Three stages of one layer each.
PIPELINE = ParallelismConfig(pipeline_parallel_size=3, pipeline=PipelineConfig("1f1b", num_microbatches=3))
BUILD = functools.partial(_deep_llama, layers=3)


def test_planning_leaves_the_processs_excepthook_as_it_was():
    """torch's init_process_group wraps sys.excepthook to put "[rank<r>]:" before every line of an uncaught
    traceback; a plan makes a fake group per rank it builds, and the prefixes piled up ("[rank2]: [rank1]: ...")."""
    hook = sys.excepthook
    plan_layout(BUILD, PIPELINE, 3, optimizers=optimizers_of)
    assert sys.excepthook is hook
