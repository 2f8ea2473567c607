# Pinned versions and cache locations, sourced by scripts/setup, scripts/test
# and scripts/demo. Bumping a version makes setup build/fetch it anew.
LLAMA_CPP_PYTHON_VERSION=0.3.36
SMOLLM2_VERSION=0.1.2
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
# The official OpenAI Python client, for the Batch API test.
OPENAI_PY_VERSION=3.54.0
# The official Anthropic Python client, for the drop-in test (llamacpp.rs).
ANTHROPIC_PY_VERSION=2.12.0

FLOWGATE_CACHE=${FLOWGATE_CACHE:-$HOME/.cache/flowgate}
LLAMA_DIR=$FLOWGATE_CACHE/llama-server-$LLAMA_CPP_PYTHON_VERSION
MODEL_DIR=$FLOWGATE_CACHE/smollm2-$SMOLLM2_VERSION
# Read by the integration tests and the demo.
export FLOWGATE_LLAMA_SERVER=$LLAMA_DIR/llama-server
export FLOWGATE_MODEL=$MODEL_DIR/$MODEL_FILE
