"""The pipeline's memory ledger predicts each rank's measured peak (#31).

passes/pipeline_memory.py walks a pipeline rank's program with the executor's buffers: its
stages' states, the activations of the micro-batches it holds (the schedule's count), the
transfers, each compute action's scratch on top while it runs. Here every bundled pipeline
file runs on the pool's ranks as `schedc run` builds it, and each rank's live heap peak
(schedc/exec/heap.py: glibc's in-use bytes, read between items and every millisecond, grown
over the states held between steps, in the steps after the first) is held to the ledger as
the DP ledger is (test_memory_measured.py): never under-predicted by more than 10%, and the
peak at item boundaries, which is read exactly, not over it by more than 10% (an op's own
transient lives well under a millisecond and the sampler sees it only now and then: the two
replicas of one FSDP rank measured 19.7 and 17.7 MB).
"""

from __future__ import annotations

import pytest

from schedc.compiler import compile_file
from schedc.lang.resources import pipeline_schedules
from tests.pool import on_pools, ranks_of

TOLERANCE = 0.10
FILES = pipeline_schedules()


@pytest.mark.parametrize("path", on_pools(FILES), ids=lambda p: p.stem)
def test_every_bundled_pipeline_peaks_as_predicted(request, path):
    c = compile_file(path)
    assert c.pipeline is not None
    ranks = ranks_of(request, c.spec.world)  # world 8 (tiny_pp2_hsdp) on the 8-rank pool
    measured = ranks.call("tests.pipeline_ranks:measure_file", c.spec.world, str(path), 3)
    for rank, got in enumerate(measured):
        report = c.pipeline.memory[rank // c.spec.dp]  # pp-outermost: replicas hold the same
        print(
            f"{path.stem} rank {rank}: predicted {report.peak:,} (between items "
            f"{report.settled_peak:,}) measured {got:,}"
        )
        assert report.peak - got >= -TOLERANCE * got, (path.stem, rank, report, got)
        assert report.settled_peak - got <= TOLERANCE * got, (path.stem, rank, report, got)
