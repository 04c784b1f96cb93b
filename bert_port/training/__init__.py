"""Fine-tuning a sequence classifier: the recipe behind `bert-port-finetune`.

settings    `FinetuneConfig`: every option once (flags, help, checks, resume rules)
steps       processes, RNG, AdamW, the learning-rate schedules, one optimiser step
evaluation  metrics for single-label, multi-label and regression; `predict`
reporting   metrics.json, the plot of the curves, TensorBoard
recipe      `FinetuneRecipe` (setup, train_epoch, evaluate, save_checkpoint, resume,
            cleanup) and `finetune(cfg)`, which runs it
"""

from .evaluation import (
    DETAIL_MAX_CLASSES,
    HEADLINE,
    WORST_CLASSES,
    evaluate,
    metrics_from_counts,
    multi_label_metrics,
    predict,
    problem_type_of,
    regression_metrics,
)
from .recipe import (
    CURVES_FILE,
    LAST_CHECKPOINT,
    METRICS_FILE,
    RESOLVED_CONFIG,
    FinetuneRecipe,
    Splits,
    _own_output_dir,
    _StopRequest,
    build_model,
    finetune,
    load_splits,
    load_trained,
    save_model,
    to_hf_model,
)
from .reporting import TENSORBOARD_DIR, compare_runs, plot_curves, write_json
from .settings import METRICS, SCHEDULERS, FinetuneConfig, FinetuneError, check_max_length, load_config_file
from .steps import (
    SCHEDULES,
    Dist,
    DivergedError,
    build_optimizer,
    build_scheduler,
    param_groups,
    setup_distributed,
    train_step,
)

__all__ = [
    "CURVES_FILE",
    "DETAIL_MAX_CLASSES",
    "HEADLINE",
    "LAST_CHECKPOINT",
    "METRICS",
    "METRICS_FILE",
    "RESOLVED_CONFIG",
    "SCHEDULERS",
    "SCHEDULES",
    "TENSORBOARD_DIR",
    "WORST_CLASSES",
    "Dist",
    "DivergedError",
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneRecipe",
    "Splits",
    "_StopRequest",
    "_own_output_dir",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "check_max_length",
    "compare_runs",
    "evaluate",
    "finetune",
    "load_config_file",
    "load_splits",
    "load_trained",
    "metrics_from_counts",
    "multi_label_metrics",
    "param_groups",
    "plot_curves",
    "predict",
    "problem_type_of",
    "regression_metrics",
    "save_model",
    "setup_distributed",
    "to_hf_model",
    "train_step",
    "write_json",
]
