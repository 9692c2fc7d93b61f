"""`localllm bench` modes: engine vs llama_cpp.Llama, HTTP load, quant ladders, speculative decoding, fuzzing."""
