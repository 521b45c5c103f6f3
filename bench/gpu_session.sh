#!/usr/bin/env bash
# One device session: install the carried wheels, then run the named steps, logging under $OUT.
#   bash bench/gpu_session.sh tests runtime piecewise server    (steps: see below)
# The device machine has torch but no jsonschema/hypothesis; carry wheels for its Python 3.12
# (device run with carry [".carry"]; .carry/ is git-ignored), made here once with:
#   pip download jsonschema hypothesis openai fastapi uvicorn prometheus_client pyzmq msgspec httpx \
#       --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --only-binary=:all: -d .carry/wheels
# (fastapi, uvicorn, prometheus_client: graphplan-serve's ASGI stack and metrics; the server steps
# and tests need them)
set -u
# graphplan is not pip-installed there: a namespace folder maps graphplan.{compiler,runtime,models,
# server,schemas} onto the checkout's folders, as `pip install -e .` does here; bench/ is on the path
# for the benches' shared helpers, as pytest's `pythonpath` puts it for the tests.
mkdir -p /tmp/gp/graphplan && for d in compiler runtime models server schemas; do ln -sfn "$PWD/$d" "/tmp/gp/graphplan/$d"; done
export PYTHONPATH="/tmp/gp:$PWD/bench" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # single host: Gloo over loopback, not the NIC
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-index --find-links .carry/wheels jsonschema hypothesis openai fastapi uvicorn prometheus_client pyzmq msgspec httpx >"$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python -c "import torch;print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; date -u; } | tee "$OUT/device.txt"
for step in "$@"; do
  case "$step" in
    tests)     timeout 520 python -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -45 ;;
    calibrate) python -m graphplan.compiler.cli compile plans/tiny-llama.yaml -o /tmp/tiny.json && timeout 200 python examples/calibrate_memory.py --table /tmp/tiny.json -o "$OUT/tiny-llama.profile.json" 2>&1 | tee "$OUT/calibrate.log" && python -m graphplan.compiler.cli compile plans/tiny-llama.yaml --memory --profile "$OUT/tiny-llama.profile.json" 2>&1 | tail -8 | tee -a "$OUT/calibrate.log" ;;
    runtime)   timeout 500 python bench/runtime_bench.py --out "$OUT/runtime_bench.md" 2>&1 | tail -40 ;;
    generate)  python -m graphplan.compiler.cli compile plans/tiny-llama.yaml -o /tmp/tiny.json && { python examples/generate.py --table /tmp/tiny.json --check; python examples/generate.py --table /tmp/tiny.json --check --continuous --chunk 32; } 2>&1 | tee "$OUT/generate.log" | grep -v "prompt tokens" ;;
    capture)   timeout 300 python bench/capture_bench.py --out "$OUT/capture_bench.md" 2>&1 | tail -14 ;;
    cprobe)    timeout 300 python bench/compiled_probe.py --no-steps --out-dir "$OUT" 2>&1 | grep "^variant" ;;
    compiled)  timeout 550 python bench/compiled_bench.py --out "$OUT/compiled_bench.md" 2>&1 | tail -16 ;;
    piecewise) timeout 400 python bench/piecewise_bench.py --out "$OUT/piecewise_bench.md" 2>&1 | tail -30 ;;
    pwtests)   timeout 400 python -m pytest -q -m gpu -p no:cacheprovider tests/test_breakable_gpu.py tests/test_piecewise_gpu.py 2>&1 | tee "$OUT/piecewise_gpu_tests.log" | tail -15 ;;
    server)    timeout 400 python bench/server_load.py --device cuda --clients 32 --requests 16 --max-tokens 64 --prompt-len 64 --time-limit 120 --out "$OUT/server_load.md" 2>&1 | tail -25 ;;
    dptests)   nvidia-smi topo -m > "$OUT/topo.txt"; timeout 420 python -m pytest -q -p no:cacheprovider tests/test_dp_gpu.py 2>&1 | tee "$OUT/dp_gpu_tests.log" | tail -15 ;;
    dpsync)    timeout 120 python bench/dp_sync_bench.py --out "$OUT/dp_sync_bench.md" 2>&1 | tail -12 ;;
    dbo)       timeout 240 python bench/dbo_bench.py --ranks 2 --modes graph --threshold 4096 --sizes 512,1024,2048,4096,8192,16384 --out "$OUT/dbo_bench.md" 2>&1 | tail -20 ;;
    dbo-pcie)  timeout 240 python bench/dbo_bench.py --ranks 2 --modes graph --nccl-p2p off --threshold 512 --sizes 128,256,512,1024,2048 --candidates 2048,4096,8192,16384 --iters 10 --repeats 3 --out "$OUT/dbo_bench_pcie.md" 2>&1 | tail -20 ;;
    probe)     timeout 240 python bench/overlap_probe.py --ranks 2 --out "$OUT/overlap_probe.md" 2>&1 | tail -60 ;;
    hftests)   timeout 500 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_hf_gpu.py 2>&1 | tee "$OUT/hf_gpu_tests.log" | tail -40 ;;
    hf)        timeout 580 python bench/hf_bench.py --out "$OUT/hf_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30 ;;
    hfpw)      timeout 500 python bench/piecewise_bench.py --model hf --out "$OUT/piecewise_hf_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    hfpwtests) timeout 400 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_hf_piecewise_gpu.py 2>&1 | tee "$OUT/hf_piecewise_gpu_tests.log" | tail -25 ;;
    hfserver)  timeout 580 python bench/hf_server_bench.py --device cuda --out "$OUT/hf_server_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -15 ;;
    ondemand)  timeout 400 python bench/ondemand_bench.py --out "$OUT/ondemand_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    realscale) timeout 560 python bench/real_scale.py --out "$OUT/real_scale.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30 ;;
    fused)     timeout 220 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fused_ops_gpu.py 2>&1 | tee "$OUT/fused_ops_gpu_tests.log" | tail -30; timeout 330 python bench/fused_ops_bench.py --out "$OUT/fused_ops_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -60 ;;
    paged)     timeout 230 python -m pytest -q -s -m gpu -p no:cacheprovider --durations=10 tests/test_paged_attention_gpu.py 2>&1 | tee "$OUT/paged_gpu_tests.log" | grep -v "^- \|^  - " | tail -30
               timeout 150 python bench/paged_attention_bench.py --methods triton,gather,floor --out "$OUT/paged_attention_bench.md" 2>"$OUT/paged_attention_bench.err" | tail -16 ;;
    pagedflex) timeout 150 python bench/paged_attention_bench.py --methods floor,triton,flex --max-model-lens 32768 --iters 30 --out "$OUT/paged_attention_flex.md" 2>"$OUT/paged_attention_flex.err" | tail -12 ;;
    loadtest)  timeout 590 python bench/load_test.py --random-weights --clients 256 --requests 2 --out "$OUT/load_test_h100.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -25 ;;
    realscale-rows) timeout 400 python bench/real_scale.py --logits rows --hf-batches '' --out "$OUT/real_scale_rows.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    capture8b) for c in cold warm; do [ $c = cold ] && export TRITON_CACHE_DIR=$(mktemp -d); timeout 280 python bench/real_scale.py --batches 1,64 --contexts 1024 --max-model-lens 4096 --hf-batches '' --out "$OUT/real_scale_capture_$c.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -5; done ;;
    realscale1b) timeout 300 python bench/real_scale.py --shape 1b --hf-batches 1 --out "$OUT/real_scale_1b.md" 2>&1 | tail -25 ;;
    longctx)   timeout 560 python bench/load_test.py --random-weights --clients 63 --requests 1 --disconnect 0 --long-prompt 32000 --long-max-tokens 512 --max-model-len 32768 --set scheduler.max_num_seqs=64 --out "$OUT/long_context.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -25 ;;
    overhead)  timeout 590 python bench/serve_overhead.py --random-weights --variants greedy,greedy+engine,greedy+async --out "$OUT/serve_overhead.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    overhead-sampled) timeout 590 python bench/serve_overhead.py --random-weights --variants sampled,sampled+async,sampled+async+fused --out "$OUT/serve_overhead_sampled.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    overhead-all) timeout 590 python bench/serve_overhead.py --random-weights --variants greedy,greedy+async,sampled,sampled+async+fused --out "$OUT/serve_overhead_all.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    hoststep)  timeout 200 python bench/host_step.py --out "$OUT/host_step.md" 2>&1 | tail -6; timeout 200 python bench/host_step.py --sampled --out "$OUT/host_step_sampled.md" 2>&1 | tail -4 ;;
    hoststep-long) for b in 64 256; do timeout 250 python bench/host_step.py --batch $b --context 1024 --non-blocking --out "$OUT/host_step_long_$b.md" 2>&1 | tail -4; done ;;
    offline)   for m in rows all; do timeout 280 python bench/offline_throughput.py --loop plain --logits $m --out "$OUT/offline_throughput_$m.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -8; done ;;
    servebench) timeout 480 python bench/serve_bench.py --plan plans/llama3-8b-h100.yaml --workload loguniform --requests 1000 --request-rate inf --client-procs 8 --offline --out "$OUT/serve_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30; [ -s "$OUT/serve_bench.md" ] && { echo; cat "$OUT/serve_bench.md"; } >> bench/results/serve_bench.md ;;
    levers)    for v in "" "scheduler.max_num_batched_tokens=2048 cudagraph.capture_sizes.ceiling=1024" "scheduler.max_num_batched_tokens=1024 cudagraph.capture_sizes.ceiling=1024" "scheduler.max_num_seqs=1024 scheduler.max_num_batched_tokens=2048 cudagraph.capture_sizes.ceiling=2048" "scheduler.max_num_seqs=1024 scheduler.max_num_batched_tokens=1024 cudagraph.capture_sizes.ceiling=1024"; do
                 sets=""; for kv in $v; do sets="$sets --set $kv"; done
                 echo "== levers: ${v:-the plan as written}"; timeout 150 python bench/offline_throughput.py --plan plans/llama3-8b-h100-throughput.yaml --loop engine $sets --out "$OUT/levers.md" 2>&1 | grep -E "wall|output tokens/s|inter-token|time to first" ; done ;;
    servebench-itl) for v in "scheduler.max_num_batched_tokens=1024 cudagraph.capture_sizes.ceiling=1024" "scheduler.max_num_batched_tokens=512"; do
                 sets=""; for kv in $v; do sets="$sets --set $kv"; done
                 timeout 280 python bench/serve_bench.py --plan plans/llama3-8b-h100-throughput.yaml $sets --workload loguniform --requests 1000 --client-procs 8 --offline --offline-loop engine --out "$OUT/serve_bench_itl.md" 2>&1 | grep -E "^\| (1000|TTFT|ITL)|served|MISSED|met" ; done ;;
    spec)      timeout 400 python bench/spec_bench.py --out "$OUT/spec_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -22 ;;
    spec-copy) timeout 580 python bench/spec_bench.py --copy-model --out "$OUT/spec_bench_copy.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -24 ;;
    servebench-1proc) timeout 400 python bench/serve_bench.py --plan plans/llama3-8b-h100.yaml --workload loguniform --requests 1000 --client-procs 8 --server-arg=--single-process --out "$OUT/serve_bench_1proc.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30 ;;
    servebench-2api) timeout 400 python bench/serve_bench.py --plan plans/llama3-8b-h100.yaml --workload loguniform --requests 1000 --client-procs 8 --server-arg='--api-server-count 2' --out "$OUT/serve_bench_2api.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30 ;;
    servebench-tp) timeout 330 python bench/serve_bench.py --plan plans/llama3-8b-h100-throughput.yaml --workload loguniform --requests 1000 --client-procs 8 --offline --offline-loop engine --out "$OUT/serve_bench_throughput.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -30 ;;
    offline-loops) for v in "--loop plain" "--loop engine" "--loop engine --set scheduler.max_num_seqs=512"; do timeout 170 python bench/offline_throughput.py $v --out "$OUT/offline_$(echo $v | tr -dc 'a-z0-9').md" 2>&1 | grep -E "output tokens/s|wall " ; done ;;
    hosttests) timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_batch.py tests/test_async_scheduling_gpu.py tests/test_openai_gpu.py tests/test_hf_gpu.py 2>&1 | tee "$OUT/host_gpu_tests.log" | tail -15 ;;
    servertests) timeout 400 python -m pytest -q -m gpu -p no:cacheprovider tests/test_openai_gpu.py tests/test_async_scheduling_gpu.py tests/test_hf_gpu.py 2>&1 | tee "$OUT/server_gpu_tests.log" | tail -15 ;;
    threadcpu) timeout 200 python bench/thread_cpu.py --clients 64 --rounds 3 --out "$OUT/thread_cpu.md" 2>&1 | tail -7 ;;
    sampling)  timeout 300 python bench/sampling_bench.py --rows 1,8,64,256 --out "$OUT/sampling_bench.md" 2>&1 | tail -20 ;;
    compiled8b) timeout 560 python bench/real_scale.py --compile --batches 1,64 --contexts 1024 --max-model-lens 4096 --hf-batches '' --out "$OUT/real_scale_compiled.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -14 ;;
    prefix)    timeout 330 python bench/serve_bench.py --plan plans/llama3-8b-h100-throughput.yaml --workload chat --requests 1000 --system-len 2000 --turns 3 --max-len 256 --client-procs 8 --prefix-caching compare --out "$OUT/prefix_chat.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -6
               timeout 260 python bench/serve_bench.py --plan plans/llama3-8b-h100-throughput.yaml --workload loguniform --requests 1000 --client-procs 8 --prefix-caching compare --out "$OUT/prefix_random.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -6 ;;
    prefixtests) timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_prefix_serving_gpu.py 2>&1 | tee "$OUT/prefix_gpu_tests.log" | tail -8 ;;
    lora)      timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_lora_gpu.py 2>&1 | tee "$OUT/lora_gpu_tests.log" | tail -12; timeout 240 python bench/lora_bench.py --out "$OUT/lora_bench.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -14 ;;
    tuneloop)  timeout 400 python examples/tune_loop.py --device cuda --out "$OUT/tune_loop.md" --json "$OUT/tune_loop.json" 2>&1 | tail -12 ;;
    tptests)   timeout 360 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_tp_gpu.py 2>&1 | tee "$OUT/tp_gpu_tests.log" | tail -15 ;;
    tp2)       timeout 300 python bench/tp_scale.py --tp 2 --shape 8b --tp1 --out "$OUT/tp2.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    tp4)       timeout 300 python bench/tp_scale.py --tp 4 --shape 70b --allreduce symm --out "$OUT/tp4.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    tp4serve)  timeout 540 python bench/serve_bench.py --shape 70b --plan plans/llama3-70b-h100-tp4.yaml --workload loguniform --requests 1000 --client-procs 8 --out "$OUT/serve_bench_70b_tp4.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -22 ;;
    tp4-quick) timeout 200 python bench/tp_scale.py --tp 4 --shape 70b --layers 8 --iters 10 --out "$OUT/tp4_quick.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -20 ;;
    tp-symm)   for n in 2 4; do [ "$(nvidia-smi -L | wc -l)" -ge $n ] && { [ $n = 2 ] && sh=8b || sh=70b; timeout 300 python bench/tp_scale.py --tp $n --shape $sh --allreduce symm --capture-plan '' --out "$OUT/tp${n}_symm.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -12; }; done ;;
    allreduce) for n in 2 4; do [ "$(nvidia-smi -L | wc -l)" -ge $n ] && timeout 170 python bench/allreduce_bench.py --ranks $n --out "$OUT/allreduce_bench_tp$n.md" 2>&1 | tail -16; done ;;
    tpserve)   timeout 240 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_tp_serve.py 2>&1 | tee "$OUT/tp_serve_gpu_tests.log" | tail -8
               for tp in 1 2; do timeout 280 python bench/serve_bench.py --plan plans/llama3-8b-h100.yaml --set parallel.tensor_parallel_size=$tp --server-arg=--no-async-scheduling --prefix-caching off --workload loguniform --requests 300 --client-procs 8 --out "$OUT/serve_bench_tp$tp.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -12; done ;;
    dpserve)   timeout 300 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_dp_serve.py 2>&1 | tee "$OUT/dp_serve_gpu_tests.log" | tail -8
               timeout 280 python bench/serve_bench.py --plan plans/llama3-8b-h100.yaml --set parallel.data_parallel_size=2 --set parallel.tensor_parallel_size=2 --server-arg=--no-async-scheduling --prefix-caching off --workload loguniform --requests 300 --client-procs 8 --out "$OUT/serve_bench_dp2tp2.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -12 ;;
    realscale-quick) timeout 280 python bench/real_scale.py --batches 1,64 --contexts 1024 --max-model-lens 4096 --hf-batches '' --out "$OUT/real_scale_quick.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -14 ;;
    itl512)    timeout 150 python bench/offline_throughput.py --plan plans/llama3-8b-h100-throughput.yaml --loop engine --out "$OUT/offline_fullbatch.md" 2>&1 | grep -E "output tokens/s|inter-token|step intervals"
               for fe in 4 1; do timeout 280 python bench/serve_bench.py --plan plans/llama3-8b-h100-throughput.yaml --set scheduler.max_num_batched_tokens=512 --server-arg="--api-server-count $fe" --workload loguniform --requests 1000 --client-procs 8 $([ $fe = 4 ] && echo "--offline --offline-loop engine") --out "$OUT/serve_bench_itl512.md" 2>&1 | grep -v "eos_token_id\|deprecated" | tail -22; done ;;
    gemv)      timeout 150 python bench/gemv_probe.py --tps 1,2 --batches 1 --iters 10 --triton 8x512x4,16x512x8,4x1024x4,32x256x8,8x256x4 --out "$OUT/gemv_probe.md" 2>&1 | tail -12
               timeout 100 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fused_ops_gpu.py -k gemv 2>&1 | tee "$OUT/gemv_gpu_tests.log" | tail -12 ;;
    *)         echo "unknown step $step" ;;
  esac
done
