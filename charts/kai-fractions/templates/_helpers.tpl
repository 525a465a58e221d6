{{/*
Names are fixed (not derived from the release name): the components' defaults and the admission
webhook's allowed identities refer to these service accounts, and the webhook configurations are
cluster-scoped, so one release per cluster.
*/}}
{{- define "kf.name" -}}kai-fractions{{- end -}}
{{- define "kf.mirror.name" -}}kai-fractions-mirror{{- end -}}
{{- define "kf.nodeAgent.name" -}}kai-fractions-node-agent{{- end -}}
{{- define "kf.admission.name" -}}kai-fractions-admission{{- end -}}

{{/* true when anything GPU-side is rendered at all */}}
{{- define "kf.enabled" -}}
{{- if eq .Values.gpuSharing "NvFractions" -}}true{{- end -}}
{{- end -}}

{{/* The one image every component runs, and the gate init container the admission webhook
injects into fractional pods. This project publishes none, so image.repository has no usable
default: the render fails, naming the value, rather than deploy pods that pull an image nobody
published while both pod webhooks fail closed with no server behind them. The old placeholder
(ghcr.io/kai-fractions/kai-fractions, the default before) is refused the same way. */}}
{{- define "kf.image" -}}
{{- $repository := .Values.image.repository | default "" | trim -}}
{{- if or (not $repository) (eq $repository "ghcr.io/kai-fractions/kai-fractions") -}}
{{- fail (printf "image.repository must be set to the registry you pushed the kai-fractions image to%s: this project publishes no image. Build it from the Dockerfile at the root of the checkout (docker build -t <registry>/kai-fractions:<version> . && docker push <registry>/kai-fractions:<version>) and install with --set image.repository=<registry>/kai-fractions,image.tag=<version>. Every component runs it, and so does the gate init container of every fractional pod" (ternary "" (printf " (%s is only a placeholder)" $repository) (not $repository))) -}}
{{- end -}}
{{- if or (contains "@" $repository) (contains ":" (last (splitList "/" $repository))) -}}
{{- fail (printf "image.repository=%s carries a tag or digest: give the repository alone and the tag (or sha256:<digest>) as image.tag" $repository) -}}
{{- end -}}
{{- /* `--set image.tag=20240101` types the tag as an integer (a values file's, as a float):
either is the tag's text, never 2.0240101e+07. */ -}}
{{- $tag := .Values.image.tag -}}
{{- if and (not (kindIs "string" $tag)) (not (kindIs "invalid" $tag)) -}}
{{- $tag = int64 $tag | toString -}}
{{- end -}}
{{- $tag = $tag | default .Chart.AppVersion -}}
{{ $repository }}{{ ternary "@" ":" (hasPrefix "sha256:" $tag) }}{{ $tag }}
{{- end -}}

{{- define "kf.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selector labels of one component: (dict "ctx" $ "component" "mirror") */}}
{{- define "kf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kf.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kf.componentLabels" -}}
{{ include "kf.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kf.serviceAccountUser" -}}
system:serviceaccount:{{ .ctx.Release.Namespace }}:{{ .name }}
{{- end -}}

{{/* KAI's binder as the API server names it: the username KAI's NvFractions admission webhook
compares with the writer of .gpus.devices (upstream KAI-Scheduler
pkg/admission/webhook/v1alpha2/nvfractions), and the identity the mirror writes as. */}}
{{- define "kf.kaiBinderUser" -}}
system:serviceaccount:{{ .Values.kaiScheduler.namespace }}:{{ .Values.kaiScheduler.binderServiceAccount }}
{{- end -}}

{{/* The GpuFractioningConfig CRD (crds/) carries this label; a CRD without it belongs to someone
else (the upstream gpu-fractioning operator). */}}
{{- define "kf.gfc.crdName" -}}gpufractioningconfigs.gpu-fractioning.kai.scheduler{{- end -}}
{{- define "kf.gfc.ownerLabel" -}}app.kubernetes.io/part-of{{- end -}}

{{/* What the cluster holds of the GpuFractioningConfig CRD and its `default` object, as YAML
{crd: OBJ-or-empty, object: OBJ-or-empty}. From `lookup`, or from
gpuFractioningConfig.simulatedLookup when that is set (tests and dry runs: `helm template` has no
cluster). The object is looked up only when the CRD exists: a lookup of a kind the API server
does not serve is an error. */}}
{{- define "kf.gfc.clusterState" -}}
{{- $sim := .Values.gpuFractioningConfig.simulatedLookup | default dict -}}
{{- if $sim -}}
crd: {{ $sim.crd | default dict | toJson }}
object: {{ $sim.object | default dict | toJson }}
{{- else -}}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" (include "kf.gfc.crdName" .) | default dict -}}
{{- $object := dict -}}
{{- if $crd -}}
{{- $object = lookup "gpu-fractioning.kai.scheduler/v1alpha1" "GpuFractioningConfig" "" "default" | default dict -}}
{{- end -}}
crd: {{ $crd | toJson }}
object: {{ $object | toJson }}
{{- end -}}
{{- end -}}

{{/*
annotationPrefix, or a failed render with the rule when it overlaps the keys kai_fractions
derives (the contract's Keys refuses it the same way): the derived keys would be read as the
user's and the binder's, and the node agent's own-node policy, which lets it write its derived
keys, would let it write the binder's. Checked here rather than in values.schema.json, whose
refusal names no rule ("'not' failed"); the schema keeps the shape.
*/}}
{{- define "kf.annotationPrefix" -}}
{{- $prefix := .Values.annotationPrefix -}}
{{- $derived := "kai-fractions.io/container." -}}
{{- if or (hasPrefix $derived $prefix) (hasPrefix $prefix $derived) -}}
{{- fail (printf "annotationPrefix=%s overlaps the keys kai_fractions derives ('%s'): give the scheduler's per-container prefix, such as 'nvidia.com/container.' (KAI's default)" $prefix $derived) -}}
{{- end -}}
{{- $prefix -}}
{{- end -}}

{{/*
The CEL predicate "this annotation key belongs to NvFractions": the configured per-container
prefix, kai_fractions' own derived keys, KAI's portion-limit keys, the pod-level legacy keys and
the mirror's record (kai-fractions.io/mirrored: protected, so a Binding or pod that carries only
it must still be reviewed). Used with `k` bound to an annotation key.
*/}}
{{- define "kf.cel.isFractionKey" -}}
k.startsWith('{{ include "kf.annotationPrefix" . }}') || k.startsWith('kai-fractions.io/container.') || k.startsWith('kai.scheduler/container.') || k in ['gpu-fraction', 'gpu-fraction.limit', 'gpu-memory', 'gpu-memory.limit', 'gpu-fraction-num-devices', 'gpu-fraction-container-name', 'kai-fractions.io/mirrored']
{{- end -}}

{{/* CEL: the pod `obj` (object or oldObject) carries an NvFractions key. Callers guard oldObject
with the operation (it is null on CREATE) rather than comparing with null. */}}
{{- define "kf.cel.podHasFractionKey" -}}
has({{ .obj }}.metadata.annotations) && {{ .obj }}.metadata.annotations.exists(k, {{ include "kf.cel.isFractionKey" .ctx }})
{{- end -}}

{{/* Pod-level security for the components that need no privilege (mirror, admission). */}}
{{- define "kf.restrictedPodSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kf.restrictedContainerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Generated TLS material as YAML (base64 values): crt, key, ca, and clientCrt/clientKey when
"client" is set. Reuses what the cluster already has (lookup), so `helm upgrade` does not rotate the
CA under clients or a webhook configuration that still trust the old one. `helm template` has no
cluster and generates a fresh set each time. One CA signs the server and the client certificate; its
key is never stored. Args: (dict "ctx" $ "secret" NAME "clientSecret" NAME-or-"" "cn" CN "dns" LIST
"days" N), and optionally "simulate" true with "simulated": the server Secret's data to use instead
of `lookup`, {} for none (tests and dry runs). `generated: true` in the result when this render made a new set (no usable Secret
was found): the caller may then have to keep trusting the old CA for a while. */}}
{{- define "kf.tls.generate" -}}
{{- $ns := .ctx.Release.Namespace -}}
{{- $server := dict -}}
{{- if .simulate -}}
{{- $server = .simulated | default dict -}}
{{- else -}}
{{- $server = (lookup "v1" "Secret" $ns .secret).data | default dict -}}
{{- end -}}
{{- $client := dict -}}
{{- if .clientSecret -}}
{{- $client = (lookup "v1" "Secret" $ns .clientSecret).data | default dict -}}
{{- end -}}
{{- $reuse := and (index $server "tls.crt") (index $server "tls.key") (index $server "ca.crt") -}}
{{- if and $reuse .clientSecret -}}
{{- $reuse = and (index $client "tls.crt") (index $client "tls.key") (eq (index $client "ca.crt") (index $server "ca.crt")) -}}
{{- end -}}
{{- if $reuse -}}
crt: {{ index $server "tls.crt" }}
key: {{ index $server "tls.key" }}
ca: {{ index $server "ca.crt" }}
{{- if .clientSecret }}
clientCrt: {{ index $client "tls.crt" }}
clientKey: {{ index $client "tls.key" }}
{{- end }}
{{- else -}}
{{- $ca := genCA (printf "%s-ca" .secret) (int .days) -}}
{{- $cert := genSignedCert .cn nil .dns (int .days) $ca -}}
generated: true
crt: {{ $cert.Cert | b64enc }}
key: {{ $cert.Key | b64enc }}
ca: {{ $ca.Cert | b64enc }}
{{- if .clientSecret }}
{{- $clientCert := genSignedCert (printf "%s-client" .secret) nil nil (int .days) $ca }}
clientCrt: {{ $clientCert.Cert | b64enc }}
clientKey: {{ $clientCert.Key | b64enc }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The DNS names a Service answers to inside the cluster: (dict "ctx" $ "name" SERVICE) */}}
{{- define "kf.serviceDNS" -}}
{{- $ns := .ctx.Release.Namespace -}}
{{- list .name (printf "%s.%s" .name $ns) (printf "%s.%s.svc" .name $ns) (printf "%s.%s.svc.cluster.local" .name $ns) | toJson -}}
{{- end -}}

{{/* The webhooks' caBundle (base64 PEM) on an upgrade that changes the CA they trust: the
chart's generated CA rotated ("delete the Secret, helm upgrade"), or the switch from it to a
provided Secret, or from one provided Secret to another signed by another CA. Such a render
points the webhook configurations at the new CA at once, while the admission pods still serve
the old certificate: until the kubelet syncs their Secret volume (about a minute), or until the
rollout replaces them when the Secret they mount changed. Every review would fail closed
meanwhile. So when some webhook the cluster has (lookup, or webhook.tls.simulatedLookup) does
not trust the new CA yet, the certificates those configurations trust that differ from it are
kept after it, in one PEM bundle; the next upgrade, whose configurations trust the new CA
already, renders it alone, as does a first install (no configuration) and every render without a
cluster (`helm template`: lookup finds nothing). Args: (dict "ctx" $ "ca" NEW-CA-BASE64). */}}
{{- define "kf.admission.rotationCaBundle" -}}
{{- $ctx := .ctx -}}
{{- $name := include "kf.admission.name" $ctx -}}
{{- $sim := $ctx.Values.webhook.tls.simulatedLookup | default dict -}}
{{- $configs := list -}}
{{- if $sim -}}
{{- $configs = list ($sim.mutating | default dict) ($sim.validating | default dict) -}}
{{- else -}}
{{- $configs = list (lookup "admissionregistration.k8s.io/v1" "MutatingWebhookConfiguration" "" $name | default dict) (lookup "admissionregistration.k8s.io/v1" "ValidatingWebhookConfiguration" "" $name | default dict) -}}
{{- end -}}
{{- $pem := "(?s)-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----" -}}
{{- $new := regexFindAll $pem (b64dec .ca) -1 -}}
{{- $kept := list -}}
{{- $switching := false -}}
{{- range $config := $configs -}}
{{- range $hook := ($config.webhooks | default list) -}}
{{- $bundle := (($hook.clientConfig | default dict).caBundle | default "") -}}
{{- $certs := regexFindAll $pem (b64dec $bundle) -1 -}}
{{- range $cert := $new -}}
{{- if not (has $cert $certs) -}}{{- $switching = true -}}{{- end -}}
{{- end -}}
{{- range $cert := $certs -}}
{{- if not (or (has $cert $new) (has $cert $kept)) -}}{{- $kept = append $kept $cert -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $switching $kept -}}
{{- printf "%s\n" (join "\n" (concat $new $kept)) | b64enc -}}
{{- else -}}
{{- .ca -}}
{{- end -}}
{{- end -}}

{{/* The release namespace must be one of its own: the webhooks leave it out (its pods serve them,
and the node agent's mount the host paths the guard refuses elsewhere), so nothing there would be
reviewed. default, kube-system and KAI's reservation namespace are refused unless
webhook.allowSharedReleaseNamespace says otherwise. */}}
{{- define "kf.checkReleaseNamespace" -}}
{{- $ns := .Release.Namespace -}}
{{- $why := "" -}}
{{- if eq $ns "default" -}}
{{- $why = "is where pods land when their manifest names no namespace, and where most users may create pods" -}}
{{- else if eq $ns "kube-system" -}}
{{- $why = "is the cluster's own system namespace" -}}
{{- else if eq $ns .Values.kaiScheduler.reservationNamespace -}}
{{- $why = "is KAI's reservation namespace (kaiScheduler.reservationNamespace)" -}}
{{- end -}}
{{- if and $why (not .Values.webhook.allowSharedReleaseNamespace) -}}
{{- fail (printf "release namespace %s %s: the webhooks leave the release namespace out (its pods serve them, and the node agent's pods mount the host paths refused everywhere else), so a pod with a hostPath volume there is never reviewed (it could reach the node agent's socket and release any pod's GPU limits) and, with webhook.excludeSystemNamespaces (the default), a fractional pod there gets no gate and no checks. Install into a namespace of its own that only cluster admins may create pods in (e.g. --namespace kai-fractions --create-namespace), or set webhook.allowSharedReleaseNamespace=true to accept that risk for every pod in %s" $ns $why $ns) -}}
{{- end -}}
{{- end -}}

{{- define "kf.admission.tlsSecretName" -}}
{{- .Values.webhook.tls.secretName | default (printf "%s-tls" (include "kf.admission.name" .)) -}}
{{- end -}}

{{/* Who may create, change or remove binder-owned and derived keys: KAI's binder, the mirror
(gRPC mode), the node agent (derived keys when following an unmodified KAI), and any extras. */}}
{{- define "kf.allowedIdentities" -}}
{{- $ids := list (include "kf.kaiBinderUser" .) -}}
{{- if .Values.mirror.enabled -}}
{{- $ids = append $ids (include "kf.serviceAccountUser" (dict "ctx" . "name" (include "kf.mirror.name" .))) -}}
{{- end -}}
{{- $ids = append $ids (include "kf.serviceAccountUser" (dict "ctx" . "name" (include "kf.nodeAgent.name" .))) -}}
{{- concat $ids .Values.webhook.extraAllowedIdentities | uniq | toJson -}}
{{- end -}}

{{/* CEL: a workload's pod template (Deployment & co: spec.template; CronJob:
spec.jobTemplate.spec.template) carries an NvFractions key. Every level is guarded with has():
object is untyped in webhook match conditions. */}}
{{- define "kf.cel.templateHasFractionKey" -}}
{{- $p := include "kf.cel.isFractionKey" . -}}
(has(object.spec) && has(object.spec.template) && has(object.spec.template.metadata) && has(object.spec.template.metadata.annotations) && object.spec.template.metadata.annotations.exists(k, {{ $p }})) || (has(object.spec) && has(object.spec.jobTemplate) && has(object.spec.jobTemplate.spec) && has(object.spec.jobTemplate.spec.template) && has(object.spec.jobTemplate.spec.template.metadata) && has(object.spec.jobTemplate.spec.template.metadata.annotations) && object.spec.jobTemplate.spec.template.metadata.annotations.exists(k, {{ $p }}))
{{- end -}}

{{/* What the cluster holds of the signing Secrets, as YAML {signing: DATA, legacy: DATA} (the
Secrets' base64 data, {} when absent): from `lookup`, or from signing.simulatedLookup when that
is set (tests and dry runs: `helm template` has no cluster). */}}
{{- define "kf.signing.clusterState" -}}
{{- $sim := .Values.signing.simulatedLookup | default dict -}}
{{- if $sim -}}
signing: {{ $sim.signing | default dict | toJson }}
legacy: {{ $sim.legacy | default dict | toJson }}
{{- else -}}
signing: {{ (lookup "v1" "Secret" .Release.Namespace .Values.signing.secretName).data | default dict | toJson }}
legacy: {{ (lookup "v1" "Secret" .Release.Namespace .Values.signing.legacyHmac.secretName).data | default dict | toJson }}
{{- end -}}
{{- end -}}

{{/* The RoleBinding kai-fractions-mirror-write-as-binder in KAI's namespace, as JSON ({} when
absent): releases whose mirror.writeAsBinder defaulted to true rendered it, so an upgrade that
finds it while mirror.writeAsBinder is false removes the mirror's impersonation of KAI's binder
(NOTES.txt warns). From `lookup`, or from mirror.simulatedLookup.writeAsBinderRoleBinding when
mirror.simulatedLookup is set (tests and dry runs: `helm template` has no cluster). */}}
{{- define "kf.mirror.writeAsBinderBinding" -}}
{{- $sim := .Values.mirror.simulatedLookup | default dict -}}
{{- if $sim -}}
{{- $sim.writeAsBinderRoleBinding | default dict | toJson -}}
{{- else -}}
{{- lookup "rbac.authorization.k8s.io/v1" "RoleBinding" .Values.kaiScheduler.namespace (printf "%s-write-as-binder" (include "kf.mirror.name" .)) | default dict | toJson -}}
{{- end -}}
{{- end -}}

{{/* The uninstallHook block, as JSON, over its defaults: `helm upgrade --reuse-values` from a
release made before the hook existed reuses that release's values, with no uninstallHook at all,
and must render as the defaults would. Read the block only through this. */}}
{{- define "kf.uninstallHook" -}}
{{- $defaults := dict "enabled" true "waitSeconds" 120 "resources" (dict "requests" (dict "cpu" "50m" "memory" "64Mi") "limits" (dict "memory" "256Mi")) "nodeSelector" dict "tolerations" list "simulatedLookup" dict -}}
{{- mergeOverwrite $defaults (deepCopy (.Values.uninstallHook | default dict)) | toJson -}}
{{- end -}}

{{/* The simulatedLookup values stand in for `lookup` where the render has no cluster (tests,
`helm template`, --dry-run=client). Left set in a real install, they would hide the cluster from
every upgrade: the chart would generate a new webhook CA (and stop trusting the old one), a new
signing key, take the GpuFractioningConfig CRD and the mirror's old RoleBinding for what the
values say, and run (or skip) the pre-upgrade hook of an upgrade to Disabled whatever the cluster
runs. So when any is set and the release namespace exists (a live cluster: `lookup` finds
it; under `helm template` it finds nothing), the render fails. */}}
{{- define "kf.checkSimulatedLookups" -}}
{{- $set := list -}}
{{- if .Values.signing.simulatedLookup -}}{{- $set = append $set "signing.simulatedLookup" -}}{{- end -}}
{{- if .Values.mirror.simulatedLookup -}}{{- $set = append $set "mirror.simulatedLookup" -}}{{- end -}}
{{- if .Values.gpuFractioningConfig.simulatedLookup -}}{{- $set = append $set "gpuFractioningConfig.simulatedLookup" -}}{{- end -}}
{{- if .Values.webhook.tls.simulatedLookup -}}{{- $set = append $set "webhook.tls.simulatedLookup" -}}{{- end -}}
{{- if (include "kf.uninstallHook" . | fromJson).simulatedLookup -}}{{- $set = append $set "uninstallHook.simulatedLookup" -}}{{- end -}}
{{- if and $set (lookup "v1" "Namespace" "" .Release.Namespace) -}}
{{- fail (printf "%s %s set, and this render reaches a cluster (namespace %s exists): these values are for tests and renders without a cluster only (helm template, --dry-run=client), where they stand in for lookup. In a real install or upgrade they hide what the cluster holds: the chart would generate a new webhook CA or signing key on every upgrade instead of keeping the ones in use, stop trusting the old CA, and take the GpuFractioningConfig CRD and the mirror's old RoleBinding for what the values say. Remove %s from your values (one kept by --reuse-values: --set %s=null)" (join ", " $set) (ternary "is" "are" (eq (len $set) 1)) .Release.Namespace (ternary "it" "them" (eq (len $set) 1)) (join "=null," $set)) -}}
{{- end -}}
{{- end -}}

{{/* How the mirror authenticates its gRPC callers (mirror.auth): "true" or "" for each of
mutual TLS and the bearer token. kf.mirror.checkAuth fails the render on a contradiction. */}}
{{- define "kf.mirror.mtls" -}}
{{- if has .Values.mirror.auth (list "mutualTLS" "mutualTLSAndToken") -}}true{{- end -}}
{{- end -}}
{{- define "kf.mirror.token" -}}
{{- if has .Values.mirror.auth (list "token" "mutualTLSAndToken") -}}true{{- end -}}
{{- end -}}
{{- define "kf.mirror.tokenSecretName" -}}
{{- .Values.mirror.tokenSecretName | default (printf "%s-token" (include "kf.mirror.name" .)) -}}
{{- end -}}
{{- define "kf.mirror.checkAuth" -}}
{{- $m := .Values.mirror -}}
{{- if hasKey $m.tls "clientAuth" -}}
{{- fail (printf "mirror.tls.clientAuth was replaced by mirror.auth: mutualTLS (the default: callers need the client certificate), token, mutualTLSAndToken, or none (no authentication, explicitly); remove mirror.tls.clientAuth") -}}
{{- end -}}
{{- if and (ne $m.auth "none") (not $m.tls.enabled) -}}
{{- fail (printf "mirror.auth=%s needs mirror.tls.enabled=true (%s); set mirror.auth=none to run the mirror unauthenticated on plaintext (only its NetworkPolicy then limits who may write allocations)" $m.auth (ternary "client certificates are checked in the TLS handshake" "without TLS the bearer token would cross the network in the clear" (eq $m.auth "mutualTLS"))) -}}
{{- end -}}
{{- if and $m.tokenSecretName (not (include "kf.mirror.token" .)) -}}
{{- fail (printf "mirror.tokenSecretName=%s is set but mirror.auth=%s checks no token: set mirror.auth=token or mutualTLSAndToken, or leave mirror.tokenSecretName empty" $m.tokenSecretName $m.auth) -}}
{{- end -}}
{{- end -}}

{{/* CEL: every field on a dotted path is present: (dict "root" "object" "path" "status.capacity")
-> has(object.status) && has(object.status.capacity). */}}
{{- define "kf.cel.has" -}}
{{- $acc := .root -}}
{{- $out := list -}}
{{- range splitList "." .path -}}
{{- $acc = printf "%s.%s" $acc . -}}
{{- $out = append $out (printf "has(%s)" $acc) -}}
{{- end -}}
{{- join " && " $out -}}
{{- end -}}

{{/* CEL: the field at a dotted path is the same in object and oldObject (both absent, or both
present and equal). Arg: the path. */}}
{{- define "kf.cel.unchanged" -}}
{{- $new := include "kf.cel.has" (dict "root" "object" "path" .) -}}
{{- $old := include "kf.cel.has" (dict "root" "oldObject" "path" .) -}}
(({{ $new }}) == ({{ $old }}) && (!({{ $new }}) || object.{{ . }} == oldObject.{{ . }}))
{{- end -}}

{{/* CEL: the keys of a string map (metadata.labels, metadata.annotations) added, changed or
removed between oldObject and object. Arg: the field under metadata. */}}
{{- define "kf.cel.changedKeys" -}}
{{- $new := printf "(has(object.metadata.%s) ? object.metadata.%s : {})" . . -}}
{{- $old := printf "(has(oldObject.metadata.%s) ? oldObject.metadata.%s : {})" . . -}}
{{ $new }}.filter(k, !(k in {{ $old }}) || {{ $old }}[k] != {{ $new }}[k]) + {{ $old }}.filter(k, !(k in {{ $new }}))
{{- end -}}

{{/* A PodDisruptionBudget's minAvailable that lets no eviction through (at least the replicas):
`kubectl drain` of a node running one would wait for ever. A percentage counts as the disruption
controller computes it, rounded UP (intstr.GetScaledValueFromIntOrPercent(..., true)): 75% of 2
replicas is 2, so it blocks as surely as minAvailable 2; 50% of 2 is 1 and leaves one eviction.
(The chart offers no maxUnavailable: Kubernetes rounds that up as well, so only 0 or 0% would
block.) Call with dict "min", "replicas" and "value" (the values path, for the message). */}}
{{- define "kf.pdb.check" -}}
{{- $replicas := int .replicas -}}
{{- $least := 0 -}}
{{- $how := "" -}}
{{- if kindIs "string" .min -}}
{{- $pct := int (trimSuffix "%" .min) -}}
{{- $least = div (add (mul $pct $replicas) 99) 100 -}}
{{- $how = printf " (Kubernetes rounds a percentage up: %s of %d replicas is %d)" .min $replicas $least -}}
{{- else -}}
{{- $least = int .min -}}
{{- end -}}
{{- if ge $least $replicas -}}
{{- fail (printf "%s.minAvailable=%v with %s.replicas=%v lets no pod be evicted%s: kubectl drain of their nodes would wait for ever. Set minAvailable below the replicas (a percentage no more than %d%%), or raise the replicas" .value .min (trimSuffix ".podDisruptionBudget" .value) .replicas $how (div (mul (sub $replicas 1) 100) $replicas)) -}}
{{- end -}}
{{- end -}}

{{/* Prometheus scraping of a component's replicas: a headless metrics Service and a
ServiceMonitor. Call with (dict "ctx" $ "component" COMPONENT "name" NAME "port" METRICS_PORT);
the caller checks serviceMonitor.enabled and that the component is rendered.
Headless: Prometheus scrapes every replica, not a load-balanced one (each replica's series are its
own). The ServiceMonitor's selector also matches the component's other Service, which has no
`metrics` port: only the headless Service's endpoints are scraped, so each pod is scraped once.
No honorLabels: the component's series carry no workload labels; the target's own stay. */}}
{{- define "kf.metricsScrape" -}}
{{- $ctx := .ctx -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}-metrics
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "kf.componentLabels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "kf.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
  ports:
    - name: metrics
      port: {{ .port }}
      targetPort: metrics
      protocol: TCP
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ .name }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "kf.componentLabels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
    {{- with $ctx.Values.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "kf.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 6 }}
  namespaceSelector:
    matchNames: [{{ $ctx.Release.Namespace }}]
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $ctx.Values.serviceMonitor.interval }}
{{- end -}}
