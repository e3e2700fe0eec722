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

{{/* A pool's StatefulSet and Service: FULLNAME-POOL. Called with (dict "root" $ "pool" $pool). At most 52
characters: a StatefulSet's pods carry a controller-revision-hash label of its name and an 11-character hash, and a
longer name gets no pods (kubernetes#64023). */}}
{{- define "kvtier.pool" -}}
{{- $name := printf "%s-%s" (include "kvtier.fullname" .root) .pool.name -}}
{{- if gt (len $name) 52 -}}
{{- fail (printf "pools[%s]: the pool's StatefulSet %s is %d characters, over Kubernetes' 52 for a StatefulSet's pods (kubernetes#64023): shorten the pool's name or the release's (fullnameOverride, nameOverride)" .pool.name $name (len $name)) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* The names the routers give a pool's engines, as a regular expression (RE2; PromQL anchors it at both ends):
the pod's, POOL-ORDINAL, through the Kubernetes API; by DNS, LABEL-ADDRESS, the Service's name and the address
with its dots and colons as dashes (IPv4: four numbers; IPv6: eight hex groups, or fewer with "--" for "::").
Called with (dict "root" $ "pool" $pool). */}}
{{- define "kvtier.engineNames" -}}
{{- $name := include "kvtier.pool" . | regexQuoteMeta -}}
{{- if eq .root.Values.router.discovery.source "kubernetes" -}}
{{- printf "%s-(0|[1-9][0-9]*)" $name -}}
{{- else -}}
{{- $h := "[0-9a-f]{1,4}" -}}
{{- $ipv4 := "[0-9]{1,3}(-[0-9]{1,3}){3}" -}}
{{- $ipv6 := printf "%s(-%s){7}|(%s(-%s){0,6})?--(%s(-%s){0,6})?" $h $h $h $h $h $h -}}
{{- printf "%s-(%s|%s)" $name $ipv4 $ipv6 -}}
{{- end -}}
{{- end -}}

{{/* Checks that span values, which values.schema.json cannot make: the pools' names and roles, the engines'
ports. Renders nothing. */}}
{{- define "kvtier.checkValues" -}}
{{- $names := list -}}
{{- $roles := list -}}
{{- range $pool := .Values.pools -}}
{{- if has $pool.name $names -}}
{{- fail (printf "pools: the name %s is given to two pools (a pool's name names its StatefulSet and Service)" $pool.name) -}}
{{- end -}}
{{- $names = append $names $pool.name -}}
{{- $roles = append $roles $pool.role -}}
{{- end -}}
{{- if eq (len (without $roles "prefill")) 0 -}}
{{- fail "pools: every pool has role prefill, and the router refuses a fleet of prefill engines only: give a pool role decode or both (the engines that answer clients)" -}}
{{- end -}}
{{- $ports := dict -}}
{{- $given := list (list "engine.port" .Values.engine.port) (list "engine.kvEventsPort" .Values.engine.kvEventsPort) (list "engine.kvReplayPort" .Values.engine.kvReplayPort) -}}
{{- with .Values.kvtier.config.metrics_port -}}
{{- $given = concat $given (list (list "kvtier.config.metrics_port" .) (list "kvtier.config.metrics_port + 1" (add . 1))) -}}
{{- end -}}
{{- range $given -}}
{{- $port := toString (index . 1) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "%s and %s are both %s: an engine binds each of them" (get $ports $port) (index . 0) $port) -}}
{{- end -}}
{{- $_ := set $ports $port (index . 0) -}}
{{- end -}}
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

{{/* The job of the routers' series (monitoring.yaml's ServiceMonitor): deploy/prometheus's rules and
deploy/grafana's dashboards read it, as the ScaledObjects do. */}}
{{- define "kvtier.routerJob" -}}
kvtier-router
{{- end -}}

{{- define "kvtier.routerService" -}}
{{- printf "%s-router" (include "kvtier.fullname" .) -}}
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


{{/* A file of the chart, refused when empty. files/ links into deploy/grafana and deploy/prometheus: a copy of the
chart without them (or made by a tool that does not follow links) would otherwise ship no rules or dashboards.
Called with (dict "root" $ "path" PATH). */}}
{{- define "kvtier.file" -}}
{{- $content := .root.Files.Get .path -}}
{{- if not (trim $content) -}}
{{- fail (printf "%s is missing or empty: the chart's files/ links to deploy/grafana and deploy/prometheus, so render the chart from the kvtier repository (deploy/helm/kvtier), or copy those files into files/ (or turn monitoring.prometheusRule or monitoring.dashboards off)" .path) -}}
{{- end -}}
{{- $content -}}
{{- end -}}
