"""Data concerns of distributed training: uneven shares of each global batch (:mod:`.balance`) and a training
loader whose epoch position is saved and restored exactly (:mod:`.resume`). No Lightning imports."""
