"""kvserve.vllm: the stubs of vLLM's engine protocol (proto package vllm.grpc.engine) and of the
gateway's shared messages (smg.grpc.common)."""
