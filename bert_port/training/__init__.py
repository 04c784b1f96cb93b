"""Training: fine-tuning a sequence or token classifier (`bert-port-finetune`) and, on the same
machinery, language models (`bert-port-pretrain`). The Python API: `finetune(settings,
**overrides)` trains, `predict(model_dir, texts)` (or a `Predictor`) predicts (`api`).

settings    `FinetuneConfig`: every option once (flags, help, checks, resume rules)
steps       processes, AdamW, the learning-rate schedules, one optimiser step, Ctrl-C
splits      the run's data: splits read, label map built, labels checked
batching    `Collator` (tokenised batches and their targets, word tags aligned to word
            pieces), chunks, evaluation order
evaluation  `evaluate` (metrics by problem type), `predict` and `predict_tokens`
reporting   training_config.json, metrics.json, the plot of the curves, TensorBoard
model_card  the model folder's README.md, as transformers' Trainer writes one
history     the run's steps, evaluations, best and early-stopping count, as plain data
run_folder  the output folder: its file names, the checks, the lock
resume      checkpoints/last-checkpoint.pt: what it holds (RNG state, data identity), its checks
reference   the model trained: the port's, or its transformers twin (`--reference hf`)
recipe      `FinetuneRecipe` (setup, train_epoch, evaluate, save_checkpoint, resume, cleanup)
prediction  `Predictor`: a fine-tuned model loaded once, one prediction row per text
api         `finetune(settings, **overrides)`, `predict(model, texts)`, `run_recipe`
identity    `train_identity`: one layer taught to return its input, pre-LN against post-LN
            (scripts/identity_task.py); not part of the recipe, imported on its own

Language-model training (`bert-port-pretrain`), on the same machinery:

lm_settings `PretrainConfig`: the shared options (`settings.TrainingSettings`) and the LM's
lm_data    texts read, grouped into blocks as run_clm.py does; `BlockCollator`; the token loss
masking    MLM masks as transformers' DataCollatorForLanguageModeling, seeded per block
pretrain   `PretrainRecipe` (a `FinetuneRecipe` with the LM's model, data, loss and
            evaluation) and `pretrain(cfg)`
"""

from .api import finetune, run_recipe, settings_of
from .api import predict as predict_texts
from .batching import Collator, chunks, length_sorted
from .evaluation import (
    DETAIL_MAX_CLASSES,
    HEADLINE,
    WORST_CLASSES,
    evaluate,
    metrics_from_counts,
    multi_label_metrics,
    predict,
    predict_tokens,
    regression_metrics,
)
from .lm_settings import PretrainConfig
from .model_card import MODEL_CARD
from .prediction import Predictor
from .pretrain import PretrainRecipe, pretrain
from .recipe import FinetuneRecipe
from .reference import build_model, load_trained, save_model
from .reporting import TENSORBOARD_DIR, compare_runs, plot_curves, write_json
from .resume import CHECKPOINTS_DIR, LAST_CHECKPOINT, check_resumable, data_identity, state_file, state_path
from .run_folder import CURVES_FILE, METRICS_FILE, RESOLVED_CONFIG, check_output_dir, own_output_dir
from .settings import (
    METRICS,
    SCHEDULERS,
    FinetuneConfig,
    FinetuneError,
    TrainingSettings,
    check_max_length,
    load_config_file,
)
from .splits import Splits, load_splits
from .steps import (
    SCHEDULES,
    Dist,
    DivergedError,
    StopRequest,
    build_optimizer,
    build_scheduler,
    param_groups,
    setup_distributed,
    train_step,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "CURVES_FILE",
    "DETAIL_MAX_CLASSES",
    "HEADLINE",
    "LAST_CHECKPOINT",
    "METRICS",
    "METRICS_FILE",
    "MODEL_CARD",
    "RESOLVED_CONFIG",
    "SCHEDULERS",
    "SCHEDULES",
    "TENSORBOARD_DIR",
    "WORST_CLASSES",
    "Collator",
    "Dist",
    "DivergedError",
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneRecipe",
    "Predictor",
    "PretrainConfig",
    "PretrainRecipe",
    "Splits",
    "StopRequest",
    "TrainingSettings",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "check_max_length",
    "check_output_dir",
    "check_resumable",
    "chunks",
    "compare_runs",
    "data_identity",
    "evaluate",
    "finetune",
    "length_sorted",
    "load_config_file",
    "load_splits",
    "load_trained",
    "metrics_from_counts",
    "multi_label_metrics",
    "own_output_dir",
    "param_groups",
    "plot_curves",
    "predict",
    "predict_texts",
    "predict_tokens",
    "pretrain",
    "regression_metrics",
    "run_recipe",
    "save_model",
    "settings_of",
    "setup_distributed",
    "state_file",
    "state_path",
    "train_step",
    "write_json",
]
