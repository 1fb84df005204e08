#!/usr/bin/env python3
"""Validates deploy/ offline: renders the kustomize base and every overlay with `kubectl kustomize`, then
checks each object strictly (an unknown field is an error) against the Kubernetes schemas bundled in
kubernetes-validate, or, for agent-sandbox's kinds, against the v1beta1 schema of the CRDs vendored in
deploy/crds/agent-sandbox. A kind with no schema fails. `--json FILE...` checks JSON objects the same way
(one object or a list per file): the SandboxTemplate and SandboxWarmPool sortie-kube builds.

Needs kubectl and `python3 -m pip install kubernetes-validate==1.37.0` (it brings jsonschema and PyYAML).
Not checked: CEL rules (`x-kubernetes-validations`), formats, and anything only an apiserver knows
(admission, defaults, immutable fields).
"""

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as missing:
    sys.exit(f"validate.py: {missing.name} is missing: python3 -m pip install kubernetes-validate==1.37.0")

DEPLOY = Path(__file__).resolve().parent
KUSTOMIZE = DEPLOY / "kustomize"
CRDS = DEPLOY / "crds" / "agent-sandbox"
# The oldest Kubernetes the manifests are meant for; kubernetes-validate picks its nearest bundled schemas.
KUBERNETES_VERSION = "1.32"
# sortie speaks only this version of agent-sandbox's API.
CRD_VERSION = "v1beta1"
# libyaml's loader when PyYAML has it: the two big CRDs take a second with the pure-Python one.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict(schema):
    """The schema with `additionalProperties: false` on every object schema that lists its properties and
    does not preserve unknown fields, so a misspelt field fails instead of being pruned by the apiserver."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and out.get("x-kubernetes-preserve-unknown-fields") is not True
    ):
        out["additionalProperties"] = False
    return out


def crd_validators():
    """`(apiVersion, kind)` → a validator of the vendored CRD's v1beta1 schema, made strict."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=LOADER)
        spec = crd["spec"]
        for version in spec["versions"]:
            if version["name"] != CRD_VERSION:
                continue
            schema = strict(version["schema"]["openAPIV3Schema"])
            api_version = f"{spec['group']}/{CRD_VERSION}"
            validators[(api_version, spec["names"]["kind"])] = jsonschema.Draft202012Validator(schema)
    if not validators:
        sys.exit(f"validate.py: no {CRD_VERSION} CRD schema in {CRDS}")
    return validators


def field_path(path):
    text = ""
    for item in path:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text or "(the object)"


def describe(error, prefix=()):
    """One line per problem: the field's path and what is wrong with it."""
    path = list(prefix) + list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        unknown = sorted(key for key in error.instance if key not in known)
        if unknown:
            return [f"{field_path(path + [key])}: unknown field" for key in unknown]
    return [f"{field_path(path)}: {error.message}"]


def check_builtin(obj):
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return describe(error)
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"no schema: {error.message}"]
    return []


def check(obj, validators):
    """The problems of one object; none when it is valid."""
    if not isinstance(obj, dict) or not isinstance(obj.get("apiVersion"), str) or not isinstance(obj.get("kind"), str):
        return ["not a Kubernetes object (apiVersion and kind are needed)"]
    if not isinstance(obj.get("metadata"), dict) or not obj["metadata"].get("name"):
        return ["metadata.name is missing"]
    group = obj["apiVersion"].rpartition("/")[0]
    validator = validators.get((obj["apiVersion"], obj["kind"]))
    if validator is None:
        if group in {api_version.rpartition("/")[0] for api_version, _ in validators}:
            return [f"no schema: agent-sandbox has no {obj['kind']} in {obj['apiVersion']} (sortie uses {CRD_VERSION})"]
        return check_builtin(obj)
    problems = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        problems += describe(error)
    # A CRD's schema says only `metadata: {type: object}`; the apiserver holds it to ObjectMeta.
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    problems += check_builtin(carrier)
    return problems


def title(obj):
    if not isinstance(obj, dict):
        return "?"
    metadata = obj.get("metadata")
    return f"{obj.get('kind', '?')}/{metadata.get('name', '?') if isinstance(metadata, dict) else '?'}"


def render(kustomization):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        sys.exit("validate.py: kubectl is not on PATH; it renders the kustomizations (`kubectl kustomize`)")
    done = subprocess.run([kubectl, "kustomize", str(kustomization)], capture_output=True, text=True)
    if done.returncode != 0:
        return None, done.stderr.strip()
    return [obj for obj in yaml.load_all(done.stdout, Loader=LOADER) if obj is not None], None


def load_json(path):
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        return None, str(error)
    return (data if isinstance(data, list) else [data]), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", nargs="+", default=[], metavar="FILE", help="also check these JSON objects")
    args = parser.parse_args()

    validators = crd_validators()
    sources = [KUSTOMIZE / "base"] + sorted(path for path in (KUSTOMIZE / "overlays").iterdir() if path.is_dir())
    batches = [(str(path.relative_to(DEPLOY)), *render(path)) for path in sources]
    batches += [(path, *load_json(path)) for path in args.json]

    passed = failed = 0
    for source, objects, error in batches:
        if objects is None:
            print(f"FAIL {source}: {error}")
            failed += 1
            continue
        for obj in objects:
            problems = check(obj, validators)
            if not problems:
                print(f"ok {title(obj)} ({source})")
                passed += 1
                continue
            print(f"FAIL {title(obj)} ({source})")
            for problem in problems:
                print(f"  {problem}")
            failed += 1
    print(f"deploy: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
