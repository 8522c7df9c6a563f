//! `--query-*` CSV in all four `--format` variants.
//!
//! nvidia-smi's CSV is not RFC 4180: cells are separated by `", "`, never quoted, and no
//! value it prints for the supported fields holds a comma. With a header (`csv`,
//! `csv,nounits`) field names come from it and may carry a unit (`power.draw [W]`); without
//! one (`noheader`) the caller passes the field list it queried. Values may carry a unit
//! (`77.71 W`) unless `nounits` was given; both are accepted, and a unit that is not the
//! field's is an error.

use thiserror::Error;

use super::{GpuQuery, MigMode, placeholder, split_unit};
use crate::source::{Absent, InputError, Value};
use crate::text;

/// Where the field names come from.
#[derive(Debug, Clone, Copy)]
pub enum Columns<'a> {
    /// The first non-empty line is the header (`csv`, `csv,nounits`).
    Header,
    /// No header (`csv,noheader`, `csv,noheader,nounits`): the fields as queried. A first line
    /// that repeats these names anyway is skipped.
    Given(&'a [&'a str]),
}

/// A parsed CSV table.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    fields: Vec<String>,
    units: Vec<Option<String>>,
    rows: Vec<Row>,
}

/// One data row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    line: usize,
    cells: Vec<String>,
}

impl Row {
    /// The 1-based line of the input this row came from.
    pub fn line(&self) -> usize {
        self.line
    }

    /// The trimmed cells, in field order.
    pub fn cells(&self) -> &[String] {
        &self.cells
    }
}

/// Why CSV output does not parse. Every variant after `Input` names the line; row errors
/// name the 1-based column and its field.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum CsvError {
    /// Too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The input is empty where a header was expected.
    #[error("no header line: the output is empty")]
    MissingHeader,
    /// A header cell is not a field name.
    #[error("line {line}, column {column}: {name:?} is not a field name")]
    BadHeader {
        /// Line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The cell.
        name: String,
    },
    /// A field is named twice.
    #[error("line {line}: field {field:?} appears twice")]
    DuplicateField {
        /// Line.
        line: usize,
        /// The field.
        field: String,
    },
    /// A row has more or fewer cells than there are fields (a truncated row, most often).
    #[error("line {line}: {found} columns, expected {expected}")]
    ColumnCount {
        /// Line.
        line: usize,
        /// Fields.
        expected: usize,
        /// Cells found.
        found: usize,
    },
    /// A numeric field holds something else.
    #[error("line {line}, column {column} ({field}): {value:?} is not a number")]
    NotANumber {
        /// Line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field.
        field: String,
        /// The cell.
        value: String,
    },
    /// A value carries a unit that is not the field's.
    #[error("line {line}, column {column} ({field}): unit {unit:?}, expected {expected:?}")]
    UnexpectedUnit {
        /// Line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field.
        field: String,
        /// The unit found.
        unit: String,
        /// The units accepted.
        expected: String,
    },
    /// A value outside the field's known set (`mig.mode.current` is `Enabled` or `Disabled`).
    #[error("line {line}, column {column} ({field}): {value:?} is not one of {expected}")]
    InvalidValue {
        /// Line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field.
        field: String,
        /// The cell.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
}

/// Splits `power.draw [W]` into the name and unit.
fn split_field(cell: &str) -> (&str, Option<&str>) {
    match cell.split_once(" [") {
        Some((name, rest)) => (name.trim(), rest.strip_suffix(']')),
        None => (cell.trim(), None),
    }
}

fn is_field_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
}

/// Parses any `--query-*` CSV into a table.
pub fn parse_table(input: &[u8], columns: Columns<'_>) -> Result<Table, CsvError> {
    let text = text::decode(input, super::MAX_CSV_BYTES)?;
    let mut lines = text::lines(text).filter(|(_, l)| !l.trim().is_empty());
    let mut fields = Vec::new();
    let mut units = Vec::new();
    let header_line = match columns {
        Columns::Header => {
            let (line, header) = lines.next().ok_or(CsvError::MissingHeader)?;
            for (i, cell) in header.split(',').enumerate() {
                let (name, unit) = split_field(cell);
                if !is_field_name(name) || unit.is_some_and(str::is_empty) {
                    return Err(CsvError::BadHeader {
                        line,
                        column: i + 1,
                        name: text::excerpt(cell.trim()),
                    });
                }
                fields.push(name.to_owned());
                units.push(unit.map(str::to_owned));
            }
            line
        }
        Columns::Given(given) => {
            for (i, cell) in given.iter().enumerate() {
                let (name, unit) = split_field(cell);
                if !is_field_name(name) {
                    return Err(CsvError::BadHeader {
                        line: 0,
                        column: i + 1,
                        name: text::excerpt(cell),
                    });
                }
                fields.push(name.to_owned());
                units.push(unit.map(str::to_owned));
            }
            0
        }
    };
    for (i, f) in fields.iter().enumerate() {
        if fields.get(..i).is_some_and(|before| before.contains(f)) {
            return Err(CsvError::DuplicateField {
                line: header_line,
                field: f.clone(),
            });
        }
    }
    let mut rows = Vec::new();
    for (line, l) in lines {
        let cells: Vec<String> = l.split(',').map(|c| c.trim().to_owned()).collect();
        if rows.is_empty()
            && matches!(columns, Columns::Given(_))
            && cells.len() == fields.len()
            && cells
                .iter()
                .zip(&fields)
                .all(|(c, f)| split_field(c).0 == f)
        {
            continue;
        }
        if cells.len() != fields.len() {
            return Err(CsvError::ColumnCount {
                line,
                expected: fields.len(),
                found: cells.len(),
            });
        }
        rows.push(Row { line, cells });
    }
    Ok(Table {
        fields,
        units,
        rows,
    })
}

impl Table {
    /// The field names, units stripped.
    pub fn fields(&self) -> &[String] {
        &self.fields
    }

    /// The data rows.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    fn column(&self, field: &str) -> Option<usize> {
        self.fields.iter().position(|f| f == field)
    }

    /// The text of `field` in `row`: a placeholder is absent, a field not in the table is
    /// [`Absent::NotQueried`].
    pub fn text<'t>(&'t self, row: &'t Row, field: &str) -> Value<&'t str> {
        let Some(cell) = self.column(field).and_then(|c| row.cells.get(c)) else {
            return Value::not_queried();
        };
        match placeholder(cell) {
            Some(a) => Value::Absent(a),
            None => Value::Present(cell.as_str()),
        }
    }

    /// The number in `field` of `row`, with the header's unit (if any) stripped from it.
    pub fn number(&self, row: &Row, field: &str) -> Result<Value<f64>, CsvError> {
        let header_unit = self
            .column(field)
            .and_then(|c| self.units.get(c))
            .and_then(|u| u.as_deref());
        match header_unit {
            Some(u) => self.number_in(row, field, &[u]),
            None => self.number_in(row, field, &[]),
        }
    }

    /// The number in `field`; a unit on the value must be one of `allowed` (any if empty).
    fn number_in(&self, row: &Row, field: &str, allowed: &[&str]) -> Result<Value<f64>, CsvError> {
        let Some(col) = self.column(field) else {
            return Ok(Value::not_queried());
        };
        let Some(cell) = row.cells.get(col) else {
            return Ok(Value::not_queried());
        };
        if let Some(a) = placeholder(cell) {
            return Ok(Value::Absent(a));
        }
        let (num, unit) = split_unit(cell);
        if let Some(unit) = unit
            && !allowed.is_empty()
            && !allowed.contains(&unit)
        {
            return Err(CsvError::UnexpectedUnit {
                line: row.line,
                column: col + 1,
                field: field.to_owned(),
                unit: text::excerpt(unit),
                expected: allowed.join(" or "),
            });
        }
        text::finite_f64(num)
            .map(Value::Present)
            .ok_or_else(|| CsvError::NotANumber {
                line: row.line,
                column: col + 1,
                field: field.to_owned(),
                value: text::excerpt(cell),
            })
    }

    fn integer<T: TryFrom<u64>>(
        &self,
        row: &Row,
        field: &str,
        allowed: &[&str],
    ) -> Result<Value<T>, CsvError> {
        let v = self.number_in(row, field, allowed)?;
        let Some(x) = v.value() else {
            return Ok(Value::Absent(
                v.absence().cloned().unwrap_or(Absent::NotQueried),
            ));
        };
        let col = self.column(field).map_or(0, |c| c + 1);
        if x.fract() != 0.0 || x < 0.0 {
            return Err(CsvError::NotANumber {
                line: row.line,
                column: col,
                field: field.to_owned(),
                value: x.to_string(),
            });
        }
        // Exact for every value below 2^53; larger ones are not memory sizes or indexes.
        T::try_from(x as u64)
            .map(Value::Present)
            .map_err(|_| CsvError::NotANumber {
                line: row.line,
                column: col,
                field: field.to_owned(),
                value: x.to_string(),
            })
    }

    fn owned_text(&self, row: &Row, field: &str) -> Value<String> {
        match self.text(row, field) {
            Value::Present(s) => Value::Present(s.to_owned()),
            Value::Absent(a) => Value::Absent(a),
        }
    }
}

/// Parses `--query-gpu` output into one [`GpuQuery`] per GPU.
pub fn parse_query_gpu(input: &[u8], columns: Columns<'_>) -> Result<Vec<GpuQuery>, CsvError> {
    let table = parse_table(input, columns)?;
    let mut gpus = Vec::with_capacity(table.rows.len());
    for row in &table.rows {
        let instant = table.number_in(row, "power.draw.instant", &["W"])?;
        let draw = table.number_in(row, "power.draw", &["W"])?;
        let power = super::report::choose_power(instant, draw, Value::not_queried());
        let mig_mode = match table.text(row, "mig.mode.current") {
            Value::Present(s) => match MigMode::parse(s) {
                Some(m) => Value::Present(m),
                None => {
                    return Err(CsvError::InvalidValue {
                        line: row.line,
                        column: table.column("mig.mode.current").map_or(0, |c| c + 1),
                        field: "mig.mode.current".to_owned(),
                        value: text::excerpt(s),
                        expected: "Enabled, Disabled",
                    });
                }
            },
            Value::Absent(a) => Value::Absent(a),
        };
        gpus.push(GpuQuery {
            line: row.line,
            index: table.integer(row, "index", &[])?,
            uuid: table.owned_text(row, "uuid"),
            name: table.owned_text(row, "name"),
            pci_bus_id: table.owned_text(row, "pci.bus_id"),
            driver_version: table.owned_text(row, "driver_version"),
            temperature_c: table.number_in(row, "temperature.gpu", &["C"])?,
            power,
            power_limit_w: table.number_in(row, "power.limit", &["W"])?,
            memory_total_mib: table.integer(row, "memory.total", &["MiB"])?,
            memory_used_mib: table.integer(row, "memory.used", &["MiB"])?,
            mig_mode,
            fan_speed_pct: table.number_in(row, "fan.speed", &["%"])?,
        });
    }
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIELDS: &[&str] = &["index", "power.draw", "power.draw.instant", "memory.used"];

    use crate::nvidia_smi::{PowerDraw, PowerKind};

    #[test]
    fn all_four_formats_give_the_same_values() {
        let inputs: [(&[u8], Columns<'_>); 4] = [
            (
                b"index, power.draw [W], power.draw.instant [W], memory.used [MiB]\n0, 77.71 W, 78.21 W, 55 MiB\n",
                Columns::Header,
            ),
            (
                b"index, power.draw [W], power.draw.instant [W], memory.used [MiB]\n0, 77.71, 78.21, 55\n",
                Columns::Header,
            ),
            (b"0, 77.71 W, 78.21 W, 55 MiB\n", Columns::Given(FIELDS)),
            (b"0, 77.71, 78.21, 55", Columns::Given(FIELDS)),
        ];
        for (input, columns) in inputs {
            let gpus = parse_query_gpu(input, columns).unwrap();
            assert_eq!(gpus.len(), 1);
            assert_eq!(gpus[0].index, Value::Present(0));
            assert_eq!(
                gpus[0].power,
                Value::Present(PowerDraw {
                    watts: 78.21,
                    kind: PowerKind::Instant
                })
            );
            assert_eq!(gpus[0].memory_used_mib, Value::Present(55));
            assert_eq!(gpus[0].temperature_c, Value::Absent(Absent::NotQueried));
        }
    }

    #[test]
    fn draw_is_used_when_instant_is_not_available() {
        let gpus = parse_query_gpu(b"0, 77.71, [N/A], 55\n", Columns::Given(FIELDS)).unwrap();
        assert_eq!(
            gpus[0].power,
            Value::Present(PowerDraw {
                watts: 77.71,
                kind: PowerKind::Draw
            })
        );
    }

    #[test]
    fn no_power_reading_at_all_is_absent_not_zero() {
        let gpus = parse_query_gpu(
            b"0, [Not Supported], [GPU is lost], 55\n",
            Columns::Given(FIELDS),
        )
        .unwrap();
        assert_eq!(
            gpus[0].power,
            Value::Absent(Absent::Failed("GPU is lost".into()))
        );
    }

    #[test]
    fn a_truncated_row_names_its_line() {
        let err =
            parse_query_gpu(b"0, 77.71, 78.21, 55\n1, 70.0", Columns::Given(FIELDS)).unwrap_err();
        assert_eq!(
            err,
            CsvError::ColumnCount {
                line: 2,
                expected: 4,
                found: 2
            }
        );
    }

    #[test]
    fn a_wrong_unit_is_an_error() {
        let err =
            parse_query_gpu(b"0, 77.71 MiB, 78.21, 55\n", Columns::Given(FIELDS)).unwrap_err();
        assert!(matches!(
            err,
            CsvError::UnexpectedUnit {
                line: 1,
                column: 2,
                ..
            }
        ));
    }

    #[test]
    fn a_repeated_header_without_header_mode_is_skipped() {
        let input =
            b"index, power.draw [W], power.draw.instant [W], memory.used [MiB]\n3, 1, 2, 4\n";
        let gpus = parse_query_gpu(input, Columns::Given(FIELDS)).unwrap();
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].index, Value::Present(3));
    }

    #[test]
    fn garbage_header_is_refused() {
        let err = parse_query_gpu(b"No devices were found\n", Columns::Header).unwrap_err();
        assert!(matches!(
            err,
            CsvError::BadHeader {
                line: 1,
                column: 1,
                ..
            }
        ));
    }
}
