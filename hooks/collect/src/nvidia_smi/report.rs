//! The full report: `-q -x` (XML) and `-q` (indented text).
//!
//! Both are read into the same raw form (strings with their line numbers) and converted by
//! one set of functions, so the XML and the text report of the same GPU give the same
//! [`GpuReport`]. The XML is parsed by `roxmltree` (its DTD line is allowed, never fetched;
//! a node limit bounds memory); the text report is a tree by indentation.
//!
//! Power: driver schemas v11 have `power_readings/power_draw`; v12 moved it to
//! `gpu_power_readings` beside `module_power_readings`; v13 prints `average_power_draw` and
//! `instant_power_draw`. The GPU section is read, never the module one.

use thiserror::Error;

use super::{GpuReport, MigDevice, MigMode, PowerDraw, PowerKind, QueryReport};
use super::{placeholder, split_unit};
use crate::source::{Absent, InputError, Value};
use crate::text;

/// Most XML nodes accepted (a full 8-GPU report has about 5,000).
const MAX_XML_NODES: u32 = 200_000;
/// Deepest nesting accepted in the text report (real reports nest 5 deep).
const MAX_TEXT_DEPTH: usize = 32;

/// Why a `-q` or `-q -x` report does not parse.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ReportError {
    /// Too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Not well-formed XML (the cause gives line and column).
    #[error("XML is not well-formed")]
    Xml(#[source] roxmltree::Error),
    /// Well-formed, but not an `nvidia-smi` report.
    #[error("line {line}: {found:?} is not the start of an nvidia-smi report")]
    NotAReport {
        /// Line.
        line: usize,
        /// What was found.
        found: String,
    },
    /// A value is not of its field's form.
    #[error("line {line} ({field}): {value:?} is not {expected}")]
    Value {
        /// Line.
        line: usize,
        /// The field.
        field: &'static str,
        /// The value.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// A required field is missing.
    #[error("line {line}: {what} has no {field}")]
    MissingField {
        /// Line of the enclosing element or section.
        line: usize,
        /// The enclosing thing.
        what: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// The text report nests deeper than any real one.
    #[error("line {line}: nested deeper than {MAX_TEXT_DEPTH} levels")]
    TooDeep {
        /// Line.
        line: usize,
    },
}

/// A raw value and its line.
#[derive(Clone, Copy)]
struct Raw<'a> {
    text: &'a str,
    line: usize,
}

#[derive(Default)]
struct RawGpu<'a> {
    line: usize,
    id: &'a str,
    product_name: Option<Raw<'a>>,
    uuid: Option<Raw<'a>>,
    minor_number: Option<Raw<'a>>,
    temperature: Option<Raw<'a>>,
    power_instant: Option<Raw<'a>>,
    power_draw: Option<Raw<'a>>,
    power_average: Option<Raw<'a>>,
    power_limit: Option<Raw<'a>>,
    memory_total: Option<Raw<'a>>,
    memory_used: Option<Raw<'a>>,
    fan_speed: Option<Raw<'a>>,
    mig_current: Option<Raw<'a>>,
    mig_pending: Option<Raw<'a>>,
    mig_devices: Vec<RawMig<'a>>,
}

#[derive(Default)]
struct RawMig<'a> {
    line: usize,
    index: Option<Raw<'a>>,
    gpu_instance_id: Option<Raw<'a>>,
    compute_instance_id: Option<Raw<'a>>,
    memory_total: Option<Raw<'a>>,
    memory_used: Option<Raw<'a>>,
}

// ---------------------------------------------------------------------------------------
// XML

/// Parses `nvidia-smi -q -x`.
pub fn parse_query_xml(input: &[u8]) -> Result<QueryReport, ReportError> {
    let text = text::decode(input, super::MAX_REPORT_BYTES)?;
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        nodes_limit: MAX_XML_NODES,
        ..roxmltree::ParsingOptions::default()
    };
    let doc = roxmltree::Document::parse_with_options(text, options).map_err(ReportError::Xml)?;
    let root = doc.root_element();
    if root.tag_name().name() != "nvidia_smi_log" {
        return Err(ReportError::NotAReport {
            line: line_of(&doc, root),
            found: text::excerpt(root.tag_name().name()),
        });
    }
    let path = |n, names: &[&str]| xpath(&doc, n, names);
    let raw = |n| xraw(&doc, n);
    let mut gpus = Vec::new();
    for g in root
        .children()
        .filter(|c| c.is_element() && c.tag_name().name() == "gpu")
    {
        // v12+ keep the GPU's own readings in gpu_power_readings; v11 in power_readings.
        let power = xchild(g, "gpu_power_readings").or_else(|| xchild(g, "power_readings"));
        let power_field = |name: &str| power.and_then(|p| raw(xchild(p, name)));
        let mut mig_devices = Vec::new();
        if let Some(devs) = xchild(g, "mig_devices") {
            for d in devs
                .children()
                .filter(|c| c.is_element() && c.tag_name().name() == "mig_device")
            {
                mig_devices.push(RawMig {
                    line: line_of(&doc, d),
                    index: path(d, &["index"]),
                    gpu_instance_id: path(d, &["gpu_instance_id"]),
                    compute_instance_id: path(d, &["compute_instance_id"]),
                    memory_total: path(d, &["fb_memory_usage", "total"]),
                    memory_used: path(d, &["fb_memory_usage", "used"]),
                });
            }
        }
        gpus.push(RawGpu {
            line: line_of(&doc, g),
            id: g.attribute("id").unwrap_or(""),
            product_name: path(g, &["product_name"]),
            uuid: path(g, &["uuid"]),
            minor_number: path(g, &["minor_number"]),
            temperature: path(g, &["temperature", "gpu_temp"]),
            power_instant: power_field("instant_power_draw"),
            power_draw: power_field("power_draw"),
            power_average: power_field("average_power_draw"),
            power_limit: power_field("current_power_limit").or_else(|| power_field("power_limit")),
            memory_total: path(g, &["fb_memory_usage", "total"]),
            memory_used: path(g, &["fb_memory_usage", "used"]),
            fan_speed: path(g, &["fan_speed"]),
            mig_current: path(g, &["mig_mode", "current_mig"]),
            mig_pending: path(g, &["mig_mode", "pending_mig"]),
            mig_devices,
        });
    }
    build(
        path(root, &["driver_version"]),
        path(root, &["cuda_version"]),
        gpus,
    )
}

type XNode<'a, 'i> = roxmltree::Node<'a, 'i>;

fn line_of(doc: &roxmltree::Document<'_>, n: XNode<'_, '_>) -> usize {
    doc.text_pos_at(n.range().start).row as usize
}

fn xchild<'a, 'i>(n: XNode<'a, 'i>, name: &str) -> Option<XNode<'a, 'i>> {
    n.children()
        .find(|c| c.is_element() && c.tag_name().name() == name)
}

fn xraw<'a>(doc: &roxmltree::Document<'_>, n: Option<XNode<'a, '_>>) -> Option<Raw<'a>> {
    n.map(|n| Raw {
        text: n.text().map_or("", str::trim),
        line: line_of(doc, n),
    })
}

fn xpath<'a>(doc: &roxmltree::Document<'_>, n: XNode<'a, '_>, names: &[&str]) -> Option<Raw<'a>> {
    let mut cur = Some(n);
    for name in names {
        cur = cur.and_then(|c| xchild(c, name));
    }
    xraw(doc, cur)
}

// ---------------------------------------------------------------------------------------
// Text

struct Node<'a> {
    key: &'a str,
    value: Option<&'a str>,
    line: usize,
    children: Vec<usize>,
}

struct Tree<'a> {
    nodes: Vec<Node<'a>>,
}

impl<'a> Tree<'a> {
    fn node(&self, i: usize) -> Option<&Node<'a>> {
        self.nodes.get(i)
    }

    fn children(&self, i: usize) -> impl Iterator<Item = (usize, &Node<'a>)> {
        self.node(i)
            .map(|n| n.children.as_slice())
            .unwrap_or_default()
            .iter()
            .filter_map(|&c| self.node(c).map(|n| (c, n)))
    }

    fn find(&self, i: usize, key: &str) -> Option<usize> {
        self.children(i).find(|(_, n)| n.key == key).map(|(c, _)| c)
    }

    fn path(&self, i: usize, keys: &[&str]) -> Option<Raw<'a>> {
        let mut cur = i;
        for k in keys {
            cur = self.find(cur, k)?;
        }
        self.node(cur).map(|n| Raw {
            text: n.value.unwrap_or(""),
            line: n.line,
        })
    }
}

/// Splits `Key      : Value` (the value may be empty); a line without ` :` is a heading.
fn split_key_value(content: &str) -> (&str, Option<&str>) {
    let mut from = 0;
    while let Some(pos) = content
        .get(from..)
        .and_then(|s| s.find(" :"))
        .map(|p| p + from)
    {
        let after = content.get(pos + 2..).unwrap_or("");
        if after.is_empty() || after.starts_with(' ') {
            let key = content.get(..pos).unwrap_or("").trim();
            return (key, Some(after.trim()));
        }
        from = pos + 2;
    }
    (content.trim(), None)
}

/// Parses `nvidia-smi -q` (the text report).
pub fn parse_query_text(input: &[u8]) -> Result<QueryReport, ReportError> {
    let text = text::decode(input, super::MAX_REPORT_BYTES)?;
    let mut tree = Tree {
        nodes: vec![Node {
            key: "",
            value: None,
            line: 0,
            children: Vec::new(),
        }],
    };
    let mut stack: Vec<(usize, usize)> = Vec::new();
    let mut first: Option<(usize, &str)> = None;
    for (line, l) in text::lines(text) {
        let content = l.trim();
        if content.is_empty() || content.starts_with('=') {
            continue;
        }
        first.get_or_insert((line, content));
        let indent = l.len() - l.trim_start().len();
        while stack.last().is_some_and(|&(i, _)| i >= indent) {
            stack.pop();
        }
        if stack.len() >= MAX_TEXT_DEPTH {
            return Err(ReportError::TooDeep { line });
        }
        let parent = stack.last().map_or(0, |&(_, n)| n);
        let (key, value) = split_key_value(content);
        let idx = tree.nodes.len();
        tree.nodes.push(Node {
            key,
            value,
            line,
            children: Vec::new(),
        });
        if let Some(p) = tree.nodes.get_mut(parent) {
            p.children.push(idx);
        }
        stack.push((indent, idx));
    }
    let gpu_sections: Vec<(usize, &str, usize)> = tree
        .children(0)
        .filter(|(_, n)| n.value.is_none())
        .filter_map(|(i, n)| n.key.strip_prefix("GPU ").map(|id| (i, id, n.line)))
        .collect();
    let driver = tree.path(0, &["Driver Version"]);
    if driver.is_none() && gpu_sections.is_empty() {
        let (line, found) = first.unwrap_or((1, ""));
        return Err(ReportError::NotAReport {
            line,
            found: text::excerpt(found),
        });
    }
    let mut gpus = Vec::new();
    for (g, id, line) in gpu_sections {
        let power = tree
            .find(g, "GPU Power Readings")
            .or_else(|| tree.find(g, "Power Readings"));
        let power_field = |key: &str| power.and_then(|p| tree.path(p, &[key]));
        let mig_devices = tree
            .children(g)
            .filter(|(_, n)| n.key == "MIG Device" && n.value.is_none())
            .map(|(d, n)| RawMig {
                line: n.line,
                index: tree.path(d, &["Index"]),
                gpu_instance_id: tree.path(d, &["GPU Instance ID"]),
                compute_instance_id: tree.path(d, &["Compute Instance ID"]),
                memory_total: tree
                    .path(d, &["Shared FB Memory Usage", "Total"])
                    .or_else(|| tree.path(d, &["FB Memory Usage", "Total"])),
                memory_used: tree
                    .path(d, &["Shared FB Memory Usage", "Used"])
                    .or_else(|| tree.path(d, &["FB Memory Usage", "Used"])),
            })
            .collect();
        gpus.push(RawGpu {
            line,
            id,
            product_name: tree.path(g, &["Product Name"]),
            uuid: tree.path(g, &["GPU UUID"]),
            minor_number: tree.path(g, &["Minor Number"]),
            temperature: tree.path(g, &["Temperature", "GPU Current Temp"]),
            power_instant: power_field("Instantaneous Power Draw"),
            power_draw: power_field("Power Draw"),
            power_average: power_field("Average Power Draw"),
            power_limit: power_field("Current Power Limit").or_else(|| power_field("Power Limit")),
            memory_total: tree.path(g, &["FB Memory Usage", "Total"]),
            memory_used: tree.path(g, &["FB Memory Usage", "Used"]),
            fan_speed: tree.path(g, &["Fan Speed"]),
            mig_current: tree.path(g, &["MIG Mode", "Current"]),
            mig_pending: tree.path(g, &["MIG Mode", "Pending"]),
            mig_devices,
        });
    }
    build(driver, tree.path(0, &["CUDA Version"]), gpus)
}

// ---------------------------------------------------------------------------------------
// Shared conversion

fn string(raw: Option<Raw<'_>>) -> Value<String> {
    match raw {
        None => Value::not_queried(),
        Some(r) => match placeholder(r.text) {
            Some(a) => Value::Absent(a),
            None => Value::Present(r.text.to_owned()),
        },
    }
}

fn measure(
    raw: Option<Raw<'_>>,
    field: &'static str,
    unit: &str,
    expected: &'static str,
) -> Result<Value<f64>, ReportError> {
    let Some(r) = raw else {
        return Ok(Value::not_queried());
    };
    if let Some(a) = placeholder(r.text) {
        return Ok(Value::Absent(a));
    }
    let (num, found_unit) = split_unit(r.text);
    let unit_ok = found_unit.is_none_or(|u| u == unit) && (unit.is_empty() || found_unit.is_some());
    match text::finite_f64(num) {
        Some(v) if unit_ok => Ok(Value::Present(v)),
        _ => Err(ReportError::Value {
            line: r.line,
            field,
            value: text::excerpt(r.text),
            expected,
        }),
    }
}

fn count<T: TryFrom<u64>>(
    raw: Option<Raw<'_>>,
    field: &'static str,
    unit: &str,
    expected: &'static str,
) -> Result<Value<T>, ReportError> {
    let Some(r) = raw else {
        return Ok(Value::not_queried());
    };
    let v = measure(raw, field, unit, expected)?;
    let Some(x) = v.value() else {
        return Ok(Value::Absent(
            v.absence().cloned().unwrap_or(Absent::NotQueried),
        ));
    };
    let bad = || ReportError::Value {
        line: r.line,
        field,
        value: text::excerpt(r.text),
        expected,
    };
    if x < 0.0 || x.fract() != 0.0 {
        return Err(bad());
    }
    T::try_from(x as u64).map(Value::Present).map_err(|_| bad())
}

fn required<T: TryFrom<u64>>(
    raw: Option<Raw<'_>>,
    line: usize,
    field: &'static str,
) -> Result<T, ReportError> {
    match count(raw, field, "", "a whole number")? {
        Value::Present(v) => Ok(v),
        Value::Absent(_) => Err(ReportError::MissingField {
            line,
            what: "MIG device",
            field,
        }),
    }
}

fn mig_mode(raw: Option<Raw<'_>>, field: &'static str) -> Result<Value<MigMode>, ReportError> {
    match string(raw) {
        Value::Present(s) => match MigMode::parse(&s) {
            Some(m) => Ok(Value::Present(m)),
            None => Err(ReportError::Value {
                line: raw.map_or(0, |r| r.line),
                field,
                value: text::excerpt(&s),
                expected: "Enabled or Disabled",
            }),
        },
        Value::Absent(a) => Ok(Value::Absent(a)),
    }
}

/// Picks the GPU's power reading: instant, else the plain draw, else the average.
pub(crate) fn choose_power(
    instant: Value<f64>,
    draw: Value<f64>,
    average: Value<f64>,
) -> Value<PowerDraw> {
    let candidates = [
        (instant, PowerKind::Instant),
        (draw, PowerKind::Draw),
        (average, PowerKind::Average),
    ];
    if let Some((watts, kind)) = candidates
        .iter()
        .find_map(|(v, k)| v.value().map(|w| (w, *k)))
    {
        return Value::Present(PowerDraw { watts, kind });
    }
    // None: say why, preferring a failure (`GPU is lost`) to a plain gap.
    let absences = candidates.iter().filter_map(|(v, _)| v.absence());
    let mut chosen = Absent::NotQueried;
    for a in absences {
        match (a, &chosen) {
            (Absent::Failed(_), _) => return Value::Absent(a.clone()),
            (Absent::NotQueried, _) => {}
            (_, Absent::NotQueried) => chosen = a.clone(),
            _ => {}
        }
    }
    Value::Absent(chosen)
}

fn build(
    driver: Option<Raw<'_>>,
    cuda: Option<Raw<'_>>,
    raw_gpus: Vec<RawGpu<'_>>,
) -> Result<QueryReport, ReportError> {
    let mut gpus = Vec::with_capacity(raw_gpus.len());
    for g in raw_gpus {
        if g.id.is_empty() {
            return Err(ReportError::MissingField {
                line: g.line,
                what: "GPU",
                field: "PCI bus id",
            });
        }
        let mut mig_devices = Vec::with_capacity(g.mig_devices.len());
        for d in g.mig_devices {
            mig_devices.push(MigDevice {
                index: required(d.index, d.line, "index")?,
                gpu_instance_id: required(d.gpu_instance_id, d.line, "GPU instance id")?,
                compute_instance_id: required(
                    d.compute_instance_id,
                    d.line,
                    "compute instance id",
                )?,
                memory_total_mib: count(d.memory_total, "MIG memory total", "MiB", "MiB")?,
                memory_used_mib: count(d.memory_used, "MIG memory used", "MiB", "MiB")?,
            });
        }
        let watts = |r, field| measure(r, field, "W", "watts (`<number> W`)");
        gpus.push(GpuReport {
            pci_bus_id: g.id.to_owned(),
            product_name: string(g.product_name),
            uuid: string(g.uuid),
            minor_number: count(g.minor_number, "minor number", "", "a whole number")?,
            temperature_c: measure(g.temperature, "GPU temperature", "C", "`<number> C`")?,
            power: choose_power(
                watts(g.power_instant, "instant power draw")?,
                watts(g.power_draw, "power draw")?,
                watts(g.power_average, "average power draw")?,
            ),
            power_limit_w: watts(g.power_limit, "power limit")?,
            memory_total_mib: count(g.memory_total, "memory total", "MiB", "`<number> MiB`")?,
            memory_used_mib: count(g.memory_used, "memory used", "MiB", "`<number> MiB`")?,
            fan_speed_pct: measure(g.fan_speed, "fan speed", "%", "`<number> %`")?,
            mig_current: mig_mode(g.mig_current, "MIG mode current")?,
            mig_pending: mig_mode(g.mig_pending, "MIG mode pending")?,
            mig_devices,
        });
    }
    Ok(QueryReport {
        driver_version: string(driver),
        cuda_version: string(cuda),
        gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_split_keeps_colons_in_values_and_headings() {
        assert_eq!(
            split_key_value("Bus Id                  : 00000000:83:00.0"),
            ("Bus Id", Some("00000000:83:00.0"))
        );
        assert_eq!(
            split_key_value("GPU 00000000:83:00.0"),
            ("GPU 00000000:83:00.0", None)
        );
        assert_eq!(split_key_value("Empty      :"), ("Empty", Some("")));
        assert_eq!(split_key_value("MIG Mode"), ("MIG Mode", None));
    }

    #[test]
    fn xml_power_sections_prefer_the_gpu_section_and_instant() {
        let xml = br#"<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">
<nvidia_smi_log><driver_version>595.58.03</driver_version><cuda_version>13.2</cuda_version>
<gpu id="00000000:0C:00.0"><product_name>X</product_name>
<gpu_power_readings><average_power_draw>139.62 W</average_power_draw><instant_power_draw>142.33 W</instant_power_draw><current_power_limit>320.00 W</current_power_limit></gpu_power_readings>
<module_power_readings><average_power_draw>999.00 W</average_power_draw><instant_power_draw>999.00 W</instant_power_draw></module_power_readings>
</gpu></nvidia_smi_log>"#;
        let r = parse_query_xml(xml).unwrap();
        assert_eq!(
            r.gpus[0].power,
            Value::Present(PowerDraw {
                watts: 142.33,
                kind: PowerKind::Instant
            })
        );
        assert_eq!(r.gpus[0].power_limit_w, Value::Present(320.0));
        assert_eq!(r.gpus[0].temperature_c, Value::Absent(Absent::NotQueried));
    }

    #[test]
    fn a_bad_xml_value_is_located() {
        let xml = b"<nvidia_smi_log>\n<gpu id=\"0\">\n<temperature>\n<gpu_temp>hot C</gpu_temp>\n</temperature></gpu></nvidia_smi_log>";
        let err = parse_query_xml(xml).unwrap_err();
        assert!(
            matches!(
                err,
                ReportError::Value {
                    line: 4,
                    field: "GPU temperature",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn malformed_xml_is_an_error_with_position() {
        let err = parse_query_xml(b"<nvidia_smi_log>\n<gpu>").unwrap_err();
        assert!(matches!(err, ReportError::Xml(_)));
        let err = parse_query_xml(b"<other/>").unwrap_err();
        assert!(matches!(err, ReportError::NotAReport { line: 1, .. }));
    }

    #[test]
    fn text_that_is_not_a_report_is_refused() {
        let err = parse_query_text(b"\nhello world\n").unwrap_err();
        assert!(matches!(err, ReportError::NotAReport { line: 2, .. }));
    }
}
