"""Known-harmless noise, silenced at its source, each with the reason.

A run prints its progress (trainer/progress.py) and its results; these messages say
nothing a user can act on and drown the rest:
- transformers draws a progress bar for every model load and save ("Loading weights",
  "Writing model shards"); a pipeline loads small models dozens of times;
- accelerate warns at every save of a model with tied embeddings that it "Removed shared
  tensor lm_head.weight": that is how tied weights are saved, and they reload tied;
- MLflow logs "Creating initial MLflow database tables" when it opens a new SQLite store,
  and hints at every dataset input that integer columns cannot hold missing values: ids
  and years here have none;
- MLflow's transformers flavour looks up a model card and a license on the Hugging Face hub
  for every model it logs, and warns twice per model that a local checkpoint folder
  (`runs/.../best/step_20`) is not a hub id: checkpoints are local by nature, and the
  registry records where each came from.
"""

from __future__ import annotations

import logging
import warnings

_HUB_LOOKUPS = ("The model card could not be retrieved from the hub", "Unable to find license information")


class _NoHubLookups(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_HUB_LOOKUPS)


def silence_known_noise() -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
    hub = logging.getLogger("mlflow.transformers")
    if not any(isinstance(f, _NoHubLookups) for f in hub.filters):
        hub.addFilter(_NoHubLookups())
