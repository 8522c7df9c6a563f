{{/* The prefix of every object's name: the release name, unless it lacks the chart's. */}}
{{- define "probity.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "probity.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "probity.labels" -}}
app.kubernetes.io/name: {{ include "probity.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "webhook"). */}}
{{- define "probity.selectorLabels" -}}
app.kubernetes.io/name: {{ include "probity.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "probity.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "probity.webhookService" -}}
{{- printf "%s-webhook" (include "probity.fullname" .) -}}
{{- end -}}

{{- define "probity.webhookHost" -}}
{{- printf "%s.%s.svc" (include "probity.webhookService" .) .Release.Namespace -}}
{{- end -}}

{{- define "probity.policiesConfigMap" -}}
{{- default (printf "%s-policies" (include "probity.fullname" .)) .Values.policies.existingConfigMap -}}
{{- end -}}

{{/* The trust ConfigMap, or a render failure naming what to set. */}}
{{- define "probity.trustConfigMap" -}}
{{- if .Values.trust.existingConfigMap -}}
{{- .Values.trust.existingConfigMap -}}
{{- else if .Values.trust.publicKey -}}
{{- printf "%s-trust" (include "probity.fullname" .) -}}
{{- else -}}
{{- fail "trust.publicKey is required with the sidecar (the pinned key manifests are signed with: the content of trusted.pub from `probity seal`), or set trust.existingConfigMap to a ConfigMap holding trusted.pub, or sidecar.enabled=false" -}}
{{- end -}}
{{- end -}}

{{- define "probity.inventoryConfigMap" -}}
{{- if .Values.sidecar.agent.existingInventoryConfigMap -}}
{{- .Values.sidecar.agent.existingInventoryConfigMap -}}
{{- else if .Values.sidecar.agent.inventory -}}
{{- printf "%s-inventory" (include "probity.fullname" .) -}}
{{- else -}}
{{- fail "sidecar.agent.inventory is required with the sidecar: give each node's zone and rack (sidecar.agent.inventory.<node>.zone, .rack), or set sidecar.agent.existingInventoryConfigMap to a ConfigMap with a key <node>.toml per node, or sidecar.enabled=false" -}}
{{- end -}}
{{- end -}}

{{- define "probity.etcdClientSecret" -}}
{{- required "etcd.clientSecret is required: the name of the Secret (ca.crt, tls.crt, tls.key) with Probity's etcd client certificate" .Values.etcd.clientSecret -}}
{{- end -}}

{{- define "probity.etcdService" -}}
{{- printf "%s-etcd" (include "probity.fullname" .) -}}
{{- end -}}

{{/* etcd's client URLs as a JSON list: the bundled members', or etcd.endpoints. */}}
{{- define "probity.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "bundled" -}}
{{- $svc := include "probity.etcdService" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.bundled.members) -}}
{{- $urls = append $urls (printf "https://%s-%d.%s.%s.svc:2379" $svc $i $svc $.Release.Namespace) -}}
{{- end -}}
{{- toJson $urls -}}
{{- else if eq .Values.etcd.mode "external" -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "etcd.endpoints is required with etcd.mode=external: etcd's client URLs, e.g. --set etcd.endpoints='{https://etcd-0.example:2379}' (or etcd.mode=bundled)" -}}
{{- end -}}
{{- toJson .Values.etcd.endpoints -}}
{{- else -}}
{{- fail (printf "etcd.mode must be \"external\" or \"bundled\", not %q" .Values.etcd.mode) -}}
{{- end -}}
{{- end -}}

{{/* The [state] table both server configurations share. */}}
{{- define "probity.stateTable" -}}
[state]
backend = "etcd"
endpoints = {{ include "probity.etcdEndpoints" .ctx }}
prefix = {{ .ctx.Values.etcd.prefix | quote }}
ca_file = "/etc/probity/etcd/ca.crt"
cert_file = "/etc/probity/etcd/tls.crt"
key_file = "/etc/probity/etcd/tls.key"
role = {{ .role | quote }}
{{- end -}}

{{/*
The webhook's TLS mode, resolved: "provided" or "cert-manager". Fails when the values
contradict each other or the cluster lacks cert-manager.
*/}}
{{- define "probity.tlsMode" -}}
{{- $mode := .Values.webhook.tls.mode -}}
{{- if not $mode -}}
{{- $mode = ternary "provided" "cert-manager" (not (empty .Values.webhook.caBundle)) -}}
{{- end -}}
{{- if eq $mode "provided" -}}
{{- if not .Values.webhook.caBundle -}}
{{- fail "webhook.caBundle is required with webhook.tls.mode=provided: the base64 PEM of the CA that signed the certificate in webhook.tls.existingSecret" -}}
{{- end -}}
{{- if not (contains "-----BEGIN CERTIFICATE-----" (b64dec .Values.webhook.caBundle)) -}}
{{- fail "webhook.caBundle must be the base64 of a PEM CA certificate, e.g. --set webhook.caBundle=\"$(base64 -w0 ca.crt)\"" -}}
{{- end -}}
{{- else if eq $mode "cert-manager" -}}
{{- if not (.Capabilities.APIVersions.Has "cert-manager.io/v1") -}}
{{- fail "webhook.tls.mode is cert-manager (the default while webhook.caBundle is empty) but the cluster has no cert-manager.io/v1 API: install cert-manager, or set webhook.caBundle (base64 PEM of your CA) with the Secret webhook.tls.existingSecret (webhook.tls.mode=provided)" -}}
{{- end -}}
{{- if .Values.webhook.url -}}
{{- fail "webhook.url calls a server outside the cluster, whose certificate cert-manager did not issue: set webhook.caBundle to the CA of its certificate (webhook.tls.mode=provided)" -}}
{{- end -}}
{{- else -}}
{{- fail (printf "webhook.tls.mode must be \"\", \"provided\" or \"cert-manager\", not %q" $mode) -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{- define "probity.webhookTlsSecret" -}}
{{- default (printf "%s-webhook-tls" (include "probity.fullname" .)) .Values.webhook.tls.existingSecret -}}
{{- end -}}

{{/* Namespaces the webhooks skip: the configured ones and always this release's. */}}
{{- define "probity.excludedNamespaces" -}}
{{- toJson (concat (default (list) .Values.webhook.excludedNamespaces) (list .Release.Namespace) | uniq) -}}
{{- end -}}

{{/* webhook.url without a trailing slash, checked. */}}
{{- define "probity.webhookUrl" -}}
{{- $url := trimSuffix "/" .Values.webhook.url -}}
{{- if $url -}}
{{- $parsed := urlParse $url -}}
{{- if or (ne $parsed.scheme "https") (not $parsed.host) (ne $parsed.path "") -}}
{{- fail (printf "webhook.url must be https://host[:port] without a path, not %q" .Values.webhook.url) -}}
{{- end -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{- define "probity.extenderUrlPrefix" -}}
{{- if .Values.scheduler.extender.urlPrefix -}}
{{- .Values.scheduler.extender.urlPrefix -}}
{{- else if .Values.webhook.url -}}
{{- printf "%s/v1/scheduler" (include "probity.webhookUrl" .) -}}
{{- else -}}
{{- printf "https://%s:443/v1/scheduler" (include "probity.webhookHost" .) -}}
{{- end -}}
{{- end -}}

{{/* One TOML value: strings quoted, booleans and numbers bare. */}}
{{- define "probity.tomlValue" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "bool" . -}}
{{- . -}}
{{- else if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- if kindIs "float64" . -}}{{- int64 . -}}{{- else -}}{{- . -}}{{- end -}}
{{- else -}}
{{- fail (printf "sidecar.agent.inventory: %v is not a string, boolean or integer" .) -}}
{{- end -}}
{{- end -}}

{{/* cert-manager's CA injection annotation, in cert-manager mode. */}}
{{- define "probity.injectCa" -}}
{{- if eq .tlsMode "cert-manager" -}}
annotations:
  cert-manager.io/inject-ca-from: {{ printf "%s/%s-webhook-tls" .ctx.Release.Namespace (include "probity.fullname" .ctx) }}
{{- end -}}
{{- end -}}

{{/* What both webhooks share: failure policy, timeout, where to call, which namespaces. */}}
{{- define "probity.webhookCommon" -}}
failurePolicy: {{ .ctx.Values.webhook.failurePolicy }}
timeoutSeconds: {{ .timeout }}
clientConfig:
  {{- if .url }}
  url: {{ printf "%s%s" .url .path | quote }}
  {{- else }}
  service:
    name: {{ include "probity.webhookService" .ctx }}
    namespace: {{ .ctx.Release.Namespace }}
    path: {{ .path }}
    port: 443
  {{- end }}
  {{- if eq .tlsMode "provided" }}
  caBundle: {{ .ctx.Values.webhook.caBundle | quote }}
  {{- end }}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values: {{ include "probity.excludedNamespaces" .ctx }}
{{- end -}}

{{- define "probity.controllerName" -}}
{{- printf "%s-controller" (include "probity.fullname" .) -}}
{{- end -}}

{{/* Probity's API as the controller calls it: controller.probityUrl, webhook.url, or the webhook Service. */}}
{{- define "probity.controllerProbityUrl" -}}
{{- if .Values.controller.probityUrl -}}
{{- $parsed := urlParse .Values.controller.probityUrl -}}
{{- if or (ne $parsed.scheme "https") (not $parsed.host) -}}
{{- fail (printf "controller.probityUrl must be https://host[:port], not %q" .Values.controller.probityUrl) -}}
{{- end -}}
{{- trimSuffix "/" .Values.controller.probityUrl -}}
{{- else if .Values.webhook.url -}}
{{- include "probity.webhookUrl" . -}}
{{- else -}}
{{- printf "https://%s:443" (include "probity.webhookHost" .) -}}
{{- end -}}
{{- end -}}

{{/*
The base64 PEM CA the controller trusts Probity's certificate with, when it comes from
the values ("" in cert-manager mode without controller.caBundle: then the ca.crt of
the serving certificate's Secret).
*/}}
{{- define "probity.controllerCaBundle" -}}
{{- $bundle := .Values.controller.caBundle -}}
{{- if and (not $bundle) (eq (include "probity.tlsMode" .) "provided") -}}
{{- $bundle = .Values.webhook.caBundle -}}
{{- end -}}
{{- if and $bundle (not (contains "-----BEGIN CERTIFICATE-----" (b64dec $bundle))) -}}
{{- fail "controller.caBundle must be the base64 of a PEM CA certificate, e.g. --set controller.caBundle=\"$(base64 -w0 ca.crt)\"" -}}
{{- end -}}
{{- $bundle -}}
{{- end -}}
