"""`make lint`: every rendered manifest against the Kubernetes API schemas of one pinned version.

Run with the lint venv's Python (kubernetes-validate is installed there, not in the project venv):
    python deploy/kubernetes/validate.py KUBERNETES_VERSION RENDERED.yaml...

Strict: a field the schema does not know fails (a typo in a probe is an error, not a silently ignored key),
and so does a kind without a schema, unless it is one of the custom resources below, whose CRDs are not
part of Kubernetes; tests/unit/test_kubernetes_manifests.py checks what matters in those instead.
"""

from __future__ import annotations

import sys

import kubernetes_validate
import yaml

CUSTOM_RESOURCES = {
    ("inference.networking.k8s.io/v1", "InferencePool"),  # Gateway API Inference Extension v1.5.0
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),  # Gateway API
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),  # sigs.k8s.io/lws
    ("monitoring.coreos.com/v1", "PodMonitor"),  # prometheus-operator
}


def main(version: str, paths: list[str]) -> int:
    failures = checked = 0
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            documents = [doc for doc in yaml.safe_load_all(handle) if doc]
        if not documents:
            print(f"{path}: no resources rendered")
            failures += 1
        for doc in documents:
            name = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_RESOURCES:
                continue
            checked += 1
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as exc:
                print(f"{name}: no Kubernetes {version} schema ({exc}); a typo in apiVersion/kind?")
                failures += 1
            except kubernetes_validate.ValidationError as exc:
                print(f"{name}: {exc.message} (at {'/'.join(map(str, exc.path))})")
                failures += 1
    print(f"kubernetes {version} schemas: {checked} resources checked, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
