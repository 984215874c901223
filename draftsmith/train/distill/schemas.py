"""Hydra schemas of the distill room's open config groups (picked up by train.config.SCHEMA_PROVIDERS)."""
from draftsmith.train.distill.launch import LauncherConfig
from draftsmith.train.distill.trainer_config import TrainerConfig

SCHEMAS = {
    "launcher/schema_launcher": LauncherConfig,
    "train/schema_trainer": TrainerConfig,
}
