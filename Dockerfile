# One image for the Dagster webserver, the daemon, the code server and every run worker.
#   docker build -t pid-platform .
# CPU torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DAGSTER_HOME=/opt/dagster/home
# git: the LeRobot assets pin a dataset folder to its git commit and publish to git targets.
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pid-platform
# TORCH_INDEX: a package index serving CPU-only torch wheels, where the default one serves CUDA.
ARG TORCH_INDEX=
RUN pip install torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
COPY pyproject.toml README.md ./
COPY loader loader
COPY pid_platform pid_platform
RUN pip install '.[platform]' dagster-postgres==0.29.27
COPY workspace.yaml dagster.yaml ./
# The executor settings the code server is pointed at (PID_EXECUTOR_CONFIG=/opt/pid-platform/deploy/...).
COPY deploy deploy
COPY deploy/ecs/dagster.yaml /opt/dagster/home/dagster.yaml

# The code server the webserver and the daemon load the code location from (ECS service
# "code"); run workers start from this same image with `dagster api execute_run`.
EXPOSE 4000
CMD ["dagster", "code-server", "start", "-h", "0.0.0.0", "-p", "4000", "-m", "pid_platform.definitions"]
