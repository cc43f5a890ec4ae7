"""`slipstream bench`: a streaming load generator for any OpenAI-compatible server, with the flag
names, metric definitions and JSON keys of `vllm bench serve`. It talks HTTP only (over TCP or a unix
socket) and never imports the engine, so it can measure Slipstream, vLLM or llama.cpp's server alike."""
