"""bpdkv: deploy vLLM prefill/decode fleets with bidirectional KV-cache transfer."""

__version__ = "0.1.0"
