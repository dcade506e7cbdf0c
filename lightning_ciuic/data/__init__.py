"""Data concerns of distributed training: uneven shares of each global batch (:mod:`.balance`), a training
loader whose epoch position is saved and restored exactly (:mod:`.resume`), the data-parallel world loaders split by
(:mod:`.world`) and the check that the ranks of a replica train on the same batch (:mod:`.check`). No Lightning
imports."""
