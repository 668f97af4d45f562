"""``python -m stare_lightning.compare``: the older name of ``python -m stare_lightning.analysis.compare``, kept
so that commands written against it keep working. The code lives in ``stare_lightning.analysis.compare``."""

from stare_lightning.analysis.compare import main

if __name__ == "__main__":
    main()
