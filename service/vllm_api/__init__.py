"""vLLM's engine protocol (vllm.grpc.engine.VllmEngine) over kvserve's engine: the handlers
(`servicer`), the request mapping (`requests`), the response messages (`responses`) and the
tokenizer files for gateways (`tokenizer_bundle`). service/server.py puts it beside
kvserve.v1.LLMService on one port."""
