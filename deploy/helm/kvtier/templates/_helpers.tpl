{{/* Names and labels every template shares. */}}

{{- define "kvtier.name" -}}
{{- default "kvtier" .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* RELEASE-kvtier, or RELEASE where it names kvtier already; at most 40 characters, so that a pool's pods
(FULLNAME-POOL-N) keep within the 63 of a label value. */}}
{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "kvtier.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvtier.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtier.labels" -}}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/part-of: kvtier
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvtier.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* A pool's StatefulSet and Service: FULLNAME-POOL. Called with (dict "root" $ "pool" $pool). */}}
{{- define "kvtier.pool" -}}
{{- printf "%s-%s" (include "kvtier.fullname" .root) .pool.name -}}
{{- end -}}

{{- define "kvtier.poolSelectorLabels" -}}
{{ include "kvtier.selectorLabels" .root }}
app.kubernetes.io/component: engine
kvtier/pool: {{ .pool.name }}
{{- end -}}

{{- define "kvtier.engineSelectorLabels" -}}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "kvtier.routerSelectorLabels" -}}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "kvtier.routerServiceAccount" -}}
{{- printf "%s-router" (include "kvtier.fullname" .) -}}
{{- end -}}

{{- define "kvtier.modelsClaim" -}}
{{- default (printf "%s-models" (include "kvtier.fullname" .)) .Values.model.claim.existingClaim -}}
{{- end -}}

{{- define "kvtier.secretName" -}}
{{- default (printf "%s-secrets" (include "kvtier.fullname" .)) .Values.kvtier.existingSecret -}}
{{- end -}}

{{- define "kvtier.hasSecrets" -}}
{{- if or .Values.kvtier.secrets .Values.kvtier.existingSecret }}true{{ end -}}
{{- end -}}

{{/* The model directory's volume, for engines and routers alike. */}}
{{- define "kvtier.modelsVolume" -}}
- name: models
{{- if .Values.model.hostPath }}
  hostPath: {path: {{ .Values.model.hostPath | quote }}, type: Directory}
{{- else }}
  persistentVolumeClaim: {claimName: {{ include "kvtier.modelsClaim" . }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "kvtier.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* kvtier's config as its ConfigMap holds it, after the checks that span values: chunk_tokens against the
engines' block size, the model under its mount. */}}
{{- define "kvtier.config" -}}
{{- $config := .Values.kvtier.config -}}
{{- $chunk := int (default 256 $config.chunk_tokens) -}}
{{- if mod $chunk (int .Values.engine.blockSize) -}}
{{- fail (printf "kvtier.config.chunk_tokens (%d) must be a multiple of engine.blockSize (%d)" $chunk (int .Values.engine.blockSize)) -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.path) -}}
{{- fail (printf "model.path (%s) must lie under model.mountPath (%s)" .Values.model.path .Values.model.mountPath) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
