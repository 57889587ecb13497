#!/usr/bin/env bash
# Run rayzero on an existing Ray cluster (KubeRay RayCluster, or any `ray start` cluster) without the
# operator: `ray job submit` runs `rayzero run` as the job's entrypoint on the head node.
#   kubectl port-forward svc/raycluster-head-svc 8265:8265 &     # a KubeRay cluster's dashboard
#   bash deploy/examples/ray-job-submit.sh
set -euo pipefail
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"

cat > /tmp/ds_config.json <<'JSON'
{
  "train_micro_batch_size_per_gpu": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.0003}},
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 2}
}
JSON

# --working-dir uploads the config next to the entrypoint; --storage must be reachable from every
# node (s3://, gs://, or a shared file:// path). To resume a previous run: --resume-from URI, or
# RAYZERO_RESUME_FROM in the runtime env as the operator does.
#
# The run's control service (rayzero status/stop/scale) listens on the head node. Its token is never
# written to --storage: it is in ~/.rayzero/control/demo-run-<hash>.token of the user Ray runs as on
# the head, so from elsewhere copy it and pass `rayzero status demo-run --storage ... --token-file F`.
# To serve TLS (otherwise the controller warns that the token crosses the network in plain text),
# make certificates once with `python -m rayzero.control_api.tls --out /etc/rayzero-control` on the head
# and add to the runtime env:
#   "env_vars": {"RAYZERO_CONTROL_TLS_CERT": "/etc/rayzero-control/tls.crt",
#                "RAYZERO_CONTROL_TLS_KEY": "/etc/rayzero-control/tls.key",
#                "RAYZERO_CONTROL_TLS_CA": "/etc/rayzero-control/ca.crt"}
# then clients pass --ca-file ca.crt (or RAYZERO_CONTROL_TLS_CA).
ray job submit \
  --working-dir /tmp --runtime-env-json '{"pip": []}' \
  -- rayzero run rayzero.demo.train:train_loop \
     --config ds_config.json --workers 2 --gpus-per-worker 1 \
     --storage s3://my-bucket/rayzero --name demo-run
