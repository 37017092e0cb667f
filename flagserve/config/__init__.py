"""Structured experiment config: schema, FlagScale compatibility, validation, derived topology."""
from flagserve.config.errors import ConfigError
from flagserve.config.load import parse_config
from flagserve.config.schema import Config, LLMModule, UserModule

__all__ = ["Config", "ConfigError", "LLMModule", "UserModule", "parse_config"]
