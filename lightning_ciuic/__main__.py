"""``python -m lightning_ciuic``: the ``lightning-ciuic`` console script (:func:`lightning_ciuic.cli.main`)."""

from lightning_ciuic.cli import main

if __name__ == "__main__":
    main()
