"""bsr: operations CLI and restore debugger for bounded-state restoration (BSR) of LLM KV state."""

__version__ = "0.1.0"

# Version of the engine admin API this package speaks (/bsr/v1/...).
API_VERSION = "v1"
