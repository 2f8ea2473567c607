# The balancer and the agent in one image (the agent runs as a sidecar with
# `command: ["agent"]`; deploy/kubernetes/). Multi-stage: built with the
# Rust toolchain, shipped on Debian slim as a non-root user.
#   docker build -t flowgate:latest .
#   docker run -p 8061:8061 flowgate:latest --inference-addr 0.0.0.0:8061
FROM rust:1-bookworm AS build
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The `dist` profile: release with fat LTO and one codegen unit (Cargo.toml).
RUN cargo build --profile dist --locked -p flowgate-balancer -p flowgate-agent \
    && install -m 0755 target/dist/balancer target/dist/agent /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin flowgate
COPY --from=build /usr/local/bin/balancer /usr/local/bin/agent /usr/local/bin/
USER 10001
# Inference (OpenAI-compatible API), management (agents, /metrics), EPP.
EXPOSE 8061 8060 9002
ENTRYPOINT ["balancer"]
