{{/*
Names. Kubernetes object names and label values are at most 63 characters (DNS-1123 labels for
Services, and the value limit for labels); a longer name makes the API server reject the object,
so every name below is truncated to 63 and a trailing "-" is trimmed. Suffixed names truncate the
prefix first so the suffix ("-webhook", "-webhook-tls") survives.
*/}}

{{/* The chart name (nameOverride wins). Also the app.kubernetes.io/name label value. */}}
{{- define "kvoffload.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The fully qualified app name: <release>-<name>, or <release> when it already contains <name>. */}}
{{- define "kvoffload.fullname" -}}
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

{{/* <fullname>-<suffix> in 63 characters: the prefix is shortened, never the suffix. */}}
{{- define "kvoffload.suffixed" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- $prefix := include "kvoffload.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $suffix }}
{{- end }}

{{/* chart label value: <name>-<version>, "+" is not allowed in label values. */}}
{{- define "kvoffload.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "kvoffload.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvoffload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Common labels on every object. */}}
{{- define "kvoffload.labels" -}}
helm.sh/chart: {{ include "kvoffload.chart" . }}
app.kubernetes.io/name: {{ include "kvoffload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvoffload
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Object names (one helper each, so templates and the operator's flags cannot disagree). */}}
{{- define "kvoffload.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvoffload.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvoffload.webhookServiceName" -}}
{{- include "kvoffload.suffixed" (list . "webhook") }}
{{- end }}

{{/* Cluster-scoped: the release namespace is not part of the name, so include it to keep two
releases of the same name in different namespaces apart. */}}
{{- define "kvoffload.policyWebhookConfigName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvoffload.fullname" .) | trunc 54 | trimSuffix "-" }}-policies
{{- end }}

{{- define "kvoffload.webhookConfigName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvoffload.fullname" .) | trunc 55 | trimSuffix "-" }}-webhook
{{- end }}

{{- define "kvoffload.certSecretName" -}}
{{- include "kvoffload.suffixed" (list . "webhook-tls") }}
{{- end }}

{{- define "kvoffload.certificateName" -}}
{{- include "kvoffload.suffixed" (list . "webhook") }}
{{- end }}

{{- define "kvoffload.issuerName" -}}
{{- include "kvoffload.suffixed" (list . "selfsigned") }}
{{- end }}

{{- define "kvoffload.peeringName" -}}
{{- default (include "kvoffload.fullname" .) .Values.operator.peering.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Cluster-scoped RBAC names carry the namespace for the same reason as the webhook config. */}}
{{- define "kvoffload.clusterRoleName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvoffload.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The ClusterRole granted per namespace by RoleBindings only (rbac.namespaces). */}}
{{- define "kvoffload.namespaceRoleName" -}}
{{- printf "%s-%s" (include "kvoffload.clusterRoleName" . | trunc 53 | trimSuffix "-") "namespace" }}
{{- end }}

{{/* Images. A digest wins over a tag; an empty tag means the chart's appVersion. */}}
{{- define "kvoffload.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "kvoffload.sidecarImage" -}}
{{- $img := .Values.injection.sidecarImage }}
{{- if or $img.repository $img.tag }}
{{- printf "%s:%s" (default .Values.image.repository $img.repository) (default (default .Chart.AppVersion .Values.image.tag) $img.tag) }}
{{- else }}
{{- include "kvoffload.image" . }}
{{- end }}
{{- end }}

{{- define "kvoffload.connectorImage" -}}
{{- $img := .Values.injection.connectorImage }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}

{{/* True ("true") when the operator must run with peering (more than one replica). */}}
{{- define "kvoffload.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{- end }}
{{- end }}

{{/* True when RBAC is namespace-scoped (the operator watches one namespace). */}}
{{- define "kvoffload.namespaced" -}}
{{- if .Values.operator.watchNamespace }}true{{- end }}
{{- end }}
