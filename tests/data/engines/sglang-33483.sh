# Quoted from https://github.com/sgl-project/sglang/issues/33483 (the --cuda-graph-max-bs 32 arm).
python -m sglang.launch_server \
  --model-path Qwen/Qwen2.5-0.5B-Instruct \
  --host 127.0.0.1 --port 30000 \
  --cuda-graph-max-bs 32 \
  --mem-fraction-static 0.80
