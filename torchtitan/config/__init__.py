"""Job configuration: `JobConfig` dataclasses and their TOML + CLI loader."""

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, HelpRequested, format_help, help_for

__all__ = ["ConfigError", "ConfigManager", "HelpRequested", "JobConfig", "format_help", "help_for"]
