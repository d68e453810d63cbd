# txmq: the broker, plus a JRE so the nightly Spark jobs run from the same image.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends default-jre-headless tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY setup.cfg setup.py pyproject.toml README.md ./
COPY txmq ./txmq
COPY protocol ./protocol
COPY broker ./broker
COPY producer ./producer
COPY consumer ./consumer
COPY ops ./ops
# installs one package, txmq (setup.py), and the console scripts txmq-broker, txmq-admin, txmq-spark
RUN pip install --no-cache-dir '.[spark]' && cd / && rm -rf /app
WORKDIR /data

# Listen on every interface inside the container; clients reach it through the published ports.
ENV BROKER_HOST=0.0.0.0 \
    BROKER_STORE_DIR=/data \
    BROKER_ADVERTISED_HOST=127.0.0.1
VOLUME ["/data"]
EXPOSE 9876 10911 5557
ENTRYPOINT ["tini", "--"]
CMD ["txmq-broker"]
# Spark jobs and the admin client from the same image:
#   docker run --rm -v txmq:/data txmq-image txmq-spark rollup --store-dir /data --out /data/rollups
