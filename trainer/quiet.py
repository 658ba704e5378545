"""Known-harmless noise, silenced at its source, each with the reason.

A run prints its progress (trainer/progress.py) and its results; these messages say
nothing a user can act on and drown the rest:
- transformers draws a progress bar for every model load and save ("Loading weights",
  "Writing model shards"); a pipeline loads small models dozens of times;
- accelerate warns at every save of a model with tied embeddings that it "Removed shared
  tensor lm_head.weight": that is how tied weights are saved, and they reload tied;
- MLflow logs "Creating initial MLflow database tables" when it opens a new SQLite store,
  and hints at every dataset input that integer columns cannot hold missing values: ids
  and years here have none.
"""

from __future__ import annotations

import logging
import warnings


def silence_known_noise() -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
