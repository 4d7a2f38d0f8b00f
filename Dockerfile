# One image for every fleet process (the command picks the stage).
# EXTRAS picks the models: `[codec]` (default: torch and SNAC for the codec LMs), `[codec,vllm]` for
# GPU images (build FROM a CUDA base that carries torch), `[espeak]` for eSpeak NG alone (no torch), `[codec,piper]` for Piper's neural voices (GPL; README.md).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libsndfile1 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY workers workers
COPY models models
COPY jobs jobs
COPY fleet fleet
COPY narrate narrate
ARG EXTRAS="[codec]"
RUN pip install --no-cache-dir ".${EXTRAS}"
ENV NARRATE_DATA_DIR=/data PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["narrate", "fleet"]
