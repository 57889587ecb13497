{{/* Names and labels shared by every template of the chart. */}}

{{- define "rayzero-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, unless the release name already contains the chart name. */}}
{{- define "rayzero-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rayzero-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rayzero-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rayzero-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rayzero-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rayzero
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rayzero-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rayzero-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator's permissions: exactly the calls it makes (operators/rayzero_operator/kube.py, plus kopf's
watches, finalizer and Events). A ClusterRole (all namespaces) or one Role per watched namespace use
the same rules. The k8s tests run the operator with these and nothing else.
*/}}
{{- define "rayzero-operator.rules" -}}
# Read and watch the jobs; patch for kopf's finalizer and bookkeeping annotations.
- apiGroups: ["rayzero.io"]
  resources: ["rayzerojobs"]
  verbs: ["get", "list", "watch", "patch"]
# Write the observed phase, conditions and restarts.
- apiGroups: ["rayzero.io"]
  resources: ["rayzerojobs/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need this where the apiserver enforces
# OwnerReferencesPermissionEnforcement.
- apiGroups: ["rayzero.io"]
  resources: ["rayzerojobs/finalizers"]
  verbs: ["update"]
# One RayJob per attempt: create it, follow its status, suspend/resume it, delete it on deletion.
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# The generated DeepSpeed config, and reading a referenced one to validate it.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# The job's Secret ([Note: the job's tokens]): created, its control credentials replaced for each
# attempt (patch), read for the control token and CA, deleted with the job; `get` also reads the type
# and labels of a job's credentialsSecret. No list/watch: the operator never looks through Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch", "delete"]
# Events on RayZeroJobs (InvalidSpec, RayJobCreated, Failed, ...).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
