"""The front end: HTTP, the OpenAI API, tokenize/detokenize, stop strings, SSE."""
